"""DeepSpeed's `deepspeed.runtime.comm.compressed.CompressedBackend`."""
from zerospeed.runtime.comm.backend import CompressedBackend

__all__ = ["CompressedBackend"]
