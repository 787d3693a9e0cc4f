"""The object DeepSpeed's 1-bit optimizers talk to: `compressed_allreduce(buffer, worker_error,
server_error, local_rank)` over the data-parallel group (an `mpu`'s, or the world)."""
from __future__ import annotations

import torch

from zerospeed.comm import backend
from zerospeed.comm.compressed import compressed_allreduce


class CompressedBackend:
    """DeepSpeed's `NcclBackend` / `MpiBackend` / `CompressedBackend` / `HcclBackend` interface."""

    def __init__(self, mpu=None):
        self.world_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.rank = backend.get_rank(self.world_group)
        self.size = backend.get_world_size(self.world_group)

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: int | None = None) -> torch.Tensor:
        """The 1-bit mean of `buffer_m` over the group, written back into it and returned (DeepSpeed's
        contract); the errors (padded sizes, as DeepSpeed allocates them) are updated in place."""
        buffer_m.copy_(compressed_allreduce(buffer_m, worker_error, server_error, self.world_group))
        return buffer_m
