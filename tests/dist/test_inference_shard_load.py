"""Shard-on-load: a model built on the meta device, filled by `init_inference(checkpoint=...)` with
only this rank's slices read from the safetensors file that `save_pretrained` wrote.

GPT-2 (Conv1D weights stored [in, out], fused c_attn, tied head saved once) and a GQA Llama (rotary
buffers that no checkpoint holds) at tp = 2 must generate exactly what the model that wrote the
checkpoint generates, with logits within 1e-5. Memory: for a 76 MiB Llama, the peak growth of each
rank's anonymous resident memory (sampled every 0.5 ms from /proc, an independent measurement) while
`init_inference` loads must stay under (model / tp + largest tensor) x 1.1 — a rank that read the
whole model, as loading into a CPU-built model does, would exceed it.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.rss import PeakSampler

PAD, NEW = 0, 5


def config(arch: str, big: bool = False):
    from transformers import GPT2Config, LlamaConfig

    if arch == "gpt2":
        return GPT2Config(vocab_size=37, n_positions=32, n_embd=16, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1)
    if big:
        return LlamaConfig(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=32,
        )
    return LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=1,
    )


def model_class(arch: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return GPT2LMHeadModel if arch == "gpt2" else LlamaForCausalLM


def prompts():
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12]])
    return ids, (ids != PAD).long()


def run(model):
    ids, mask = prompts()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD
    )
    return logits, tokens


def _served(paths):
    import safetensors.torch  # noqa: F401  (imported before the measurement starts)

    import zerospeed

    out = {}
    for arch in ("gpt2", "llama"):
        with torch.device("meta"):
            model = model_class(arch)(config(arch))
        engine = zerospeed.init_inference(
            model, checkpoint=paths[arch], tensor_parallel={"tp_size": 2}, dtype=torch.float32
        )
        out[arch] = run(engine)
    with torch.device("meta"):
        big = model_class("llama")(config("llama", big=True))
    with PeakSampler() as peak:
        zerospeed.init_inference(big, checkpoint=paths["big"], tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    out["peak"] = peak.growth_bytes
    return out


@pytest.mark.timeout(150)
def test_meta_model_loads_only_its_shards(tmp_path):
    paths, reference = {}, {}
    for arch in ("gpt2", "llama"):
        torch.manual_seed(0)
        model = model_class(arch)(config(arch)).eval()
        model.save_pretrained(tmp_path / arch)
        paths[arch], reference[arch] = str(tmp_path / arch), run(model)
    torch.manual_seed(0)
    big = model_class("llama")(config("llama", big=True))
    big.save_pretrained(tmp_path / "big")
    paths["big"] = str(tmp_path / "big")
    sizes = [p.numel() * 4 for p in big.parameters()]
    bound = (sum(sizes) / 2 + max(sizes)) * 1.1
    del big
    for rank, res in enumerate(run_distributed(_served, 2, paths, timeout=120)):
        for arch in ("gpt2", "llama"):
            (logits, tokens), (want_logits, want_tokens) = res[arch], reference[arch]
            assert (logits - want_logits).abs().max() <= 1e-5, f"{arch} rank {rank}"
            assert torch.equal(tokens, want_tokens), f"{arch} rank {rank}"
        assert res["peak"] < bound, f"rank {rank}: peak {res['peak'] / 2**20:.1f} MiB >= {bound / 2**20:.1f} MiB"
        print(
            f"rank {rank}: load peak {res['peak'] / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
            f"model {sum(sizes) / 2**20:.1f} MiB"
        )
