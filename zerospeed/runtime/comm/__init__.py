"""DeepSpeed's `deepspeed.runtime.comm` backends of the 1-bit optimizers, on zerospeed's compressed
all-reduce (zerospeed/comm/compressed.py): one implementation whatever the backend's name."""
