"""DeepSpeed's `deepspeed.runtime.comm.mpi.MpiBackend`: the same compressed all-reduce on the job's own backend."""
from zerospeed.runtime.comm.backend import CompressedBackend


class MpiBackend(CompressedBackend):
    """Accepts DeepSpeed's arguments (`mpu`, `cuda_aware`)."""

    def __init__(self, cuda_aware: bool = False, mpu=None):
        super().__init__(mpu)
        self.cuda_aware = cuda_aware


__all__ = ["MpiBackend"]
