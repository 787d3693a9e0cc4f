"""1-bit Adam, 0/1 Adam and 1-bit LAMB (DeepSpeed's `deepspeed.runtime.fp16.onebit`); see docs/comm_compression.md."""

from zerospeed.optim.onebit.adam import OnebitAdam
from zerospeed.optim.onebit.lamb import OnebitLamb
from zerospeed.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
