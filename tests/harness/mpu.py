"""The smallest Megatron-style model-parallel unit (mpu) for tests and benchmarks."""

from __future__ import annotations

from zerospeed import comm


class GroupMpu:
    """An mpu whose model-parallel group is `group` (e.g. every process): what
    `zerospeed.activation.configure(mpu_=...)` and `initialize(mpu=...)` ask of one."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_rank(self) -> int:
        return comm.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return comm.get_world_size(self.group)
