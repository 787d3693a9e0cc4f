"""DeepSpeed's `deepspeed.runtime.pipe` path; the pipeline lives in `zerospeed.parallel.pipeline`."""
