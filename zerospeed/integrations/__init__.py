"""Integrations with other libraries. Each is imported on demand (the library it wraps is optional):

- `zerospeed.integrations.transformers` — the transformers `Trainer` / `TrainingArguments` trained
  through a zerospeed Engine (`--deepspeed cfg.json` as with DeepSpeed). Needs `pip install
  zerospeed[transformers]`.
"""
