"""DeepSpeed's `deepspeed.runtime.comm.hccl.HcclBackend`: the same compressed all-reduce on the job's own backend."""
from zerospeed.runtime.comm.backend import CompressedBackend


class HcclBackend(CompressedBackend):
    """Accepts DeepSpeed's argument (`mpu`)."""


__all__ = ["HcclBackend"]
