"""DeepSpeed's path `deepspeed.runtime.sequence_parallel` (Ulysses / ALST for transformers models)."""
