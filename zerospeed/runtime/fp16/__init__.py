"""DeepSpeed's `deepspeed.runtime.fp16` namespace: the 1-bit optimizers live in `onebit`."""
