"""The small models and data the examples, benchmarks and tests share (not part of the zerospeed wheel).

`models`: the byte-level GPT of the demo and a tiny MLP; `data`: byte sequences from the Python
standard library's own sources (on every machine, nothing downloaded); `gpt_layers`: the GPT as a
pipeline layer list; `sequence_models`: a GPT for sequence-parallel runs.
"""
