"""Split a checkpointed input across the model-parallel ranks, and gather it back.

Megatron-style tensor parallelism gives every rank of a model-parallel group the same block input;
keeping all M copies is waste. Each rank keeps one equal chunk of the flattened tensor (the last
chunk zero-padded, so any size works) and the recompute all-gathers the chunks.

The index math is pure; only ``gather_partitions`` talks to the network (through zerospeed.comm).
"""

from __future__ import annotations

import torch

from zerospeed import comm


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements each rank keeps: ceil(numel / world_size)."""
    if world_size < 1 or numel < 0:
        raise ValueError(f"chunk_numel needs numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    return -(-numel // world_size)


def chunk_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the real (unpadded) elements rank ``rank`` keeps; may be empty at the tail."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    size = chunk_numel(numel, world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def copy_partition(flat: torch.Tensor, world_size: int, rank: int, dest: torch.Tensor) -> torch.Tensor:
    """Write this rank's chunk of the 1-D ``flat`` into ``dest`` (``chunk_numel`` elements), zero-padded."""
    start, stop = chunk_bounds(flat.numel(), world_size, rank)
    n = stop - start
    if n < dest.numel() and dest.device != flat.device:
        # Note [no host write into a pinned slot]: zeroing host memory runs at once, while the device
        # may still have a copy queued that reads this reused arena slot (the last step's restore):
        # pad on the device and make the whole chunk one stream-ordered copy instead.
        padded = torch.zeros(dest.numel(), dtype=flat.dtype, device=flat.device)
        padded[:n].copy_(flat[start:stop])
        dest.copy_(padded, non_blocking=True)
        return dest
    dest[:n].copy_(flat[start:stop], non_blocking=True)
    dest[n:].zero_()
    return dest


def gather_partitions(local: torch.Tensor, numel: int, world_size: int, group) -> torch.Tensor:
    """All ranks' chunks, concatenated in rank order and trimmed to the first ``numel`` elements."""
    full = torch.empty(local.numel() * world_size, dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(full, local, group=group)
    return full[:numel]
