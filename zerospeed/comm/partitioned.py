"""A tensor split into one flat contiguous part per rank of a group (DeepSpeed's `PartitionedTensor`).

Rank r keeps elements [bounds[r], bounds[r + 1]) of the flattened tensor, the bounds of
`partition_uniform(numel, world)` (the first `numel % world` ranks hold one element more). `full()`
gathers the parts back in one all-gather (uneven parts are padded to the largest for the wire).
`to_meta()` / `from_meta()` carry the shape and bounds as one int64 tensor, DeepSpeed's layout:
`[ndim, *shape, world, rank, *bounds]`.
"""

from __future__ import annotations

import math

import torch

from zerospeed.comm.backend import all_gather_into_tensor, get_rank, get_world_size


def uniform_bounds(numel: int, parts: int) -> list[int]:
    """[0, ..., numel]: equal sizes, the first `numel % parts` one larger (empty parts past `numel`)."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


class PartitionedTensor:
    """This rank's flat part of `tensor` over `group` (all ranks pass the same full tensor)."""

    def __init__(self, tensor: torch.Tensor, group=None, partition_meta=None) -> None:
        self.group = group
        self.num_parts = get_world_size(group)
        self.rank = get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = uniform_bounds(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:stop].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group=None, device=None) -> PartitionedTensor:
        """Rebuild from `to_meta()`'s tensor and this rank's part (e.g. received from another stage)."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be int64 (from to_meta()), got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        shape, rest = values[1 : 1 + ndim], values[1 + ndim :]
        part = cls.__new__(cls)
        part.group = group
        part.num_parts, part.rank = get_world_size(group), get_rank(group)
        if (rest[0], rest[1]) != (part.num_parts, part.rank):
            raise ValueError(
                f"PartitionedTensor.from_meta: the meta was made by rank {rest[1]} of {rest[0]} parts; "
                f"this is rank {part.rank} of {part.num_parts}"
            )
        part.orig_size = shape
        part.orig_device = local_part.device if device is None else torch.device(device)
        part.partition = rest[2:]
        part.local_data = local_part.detach()
        part.even_split = math.prod(shape) % part.num_parts == 0
        return part

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's part, on `device` (default: the original's)."""
        device = self.orig_device if device is None else device
        sizes = [b - a for a, b in zip(self.partition[:-1], self.partition[1:])]
        width = max(sizes)
        mine = torch.zeros(width, dtype=self.local_data.dtype, device=self.local_data.device)
        mine[: self.local_data.numel()] = self.local_data
        gathered = torch.empty(width * self.num_parts, dtype=mine.dtype, device=mine.device)
        all_gather_into_tensor(gathered, mine, group=self.group)
        flat = torch.cat([gathered[k * width : k * width + n] for k, n in enumerate(sizes)])
        return flat.view(self.orig_size).to(device)

    def to_meta(self) -> torch.Tensor:
        """Shape and bounds as one int64 tensor: `[ndim, *shape, world, rank, *bounds]`."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
