"""DeepSpeed's `deepspeed.runtime.comm.nccl.NcclBackend`: the same compressed all-reduce on the job's own backend."""
from zerospeed.runtime.comm.backend import CompressedBackend


class NcclBackend(CompressedBackend):
    """Accepts DeepSpeed's argument (`mpu`)."""


__all__ = ["NcclBackend"]
