"""How one rank's piece of a tensor sits in the full tensor: the vocabulary of split parameters.

A tensor-parallel layer describes each parameter it splits with one `ShardSpec` per rank
(`zerospeed.parallel.tensor` builds them: column, row, vocab, fused and head-aware layouts), and a
checkpoint uses the same specs to assemble full tensors from the pieces and cut any rank's piece back
out (Note [canonical tensors] in tensor_parallel.py). The type lives here, below both, so that the
checkpoint reads what the parallel layers write without importing them.

Pure functions of integers and tensors in hand: no process group is consulted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """One rank's piece of a full tensor: the concatenation, along `dim`, of the full tensor's
    `segments` (start, length). `replicas` is how many ranks of the tp group hold this same piece
    (1: a true shard; >1: GQA kv heads shared by several ranks)."""

    dim: int
    full_size: int
    segments: tuple[tuple[int, int], ...]
    replicas: int = 1

    @property
    def local_size(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def contiguous(self) -> bool:
        """One segment: the local tensor is a plain slice of the full one."""
        return len(self.segments) == 1


Specs = tuple[ShardSpec, ...]
"""One layout per tp rank, in group-rank order."""


def take(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The local piece of `full` (a new contiguous tensor)."""
    if full.shape[spec.dim] != spec.full_size:
        raise ValueError(
            f"tensor of shape {tuple(full.shape)} has {full.shape[spec.dim]} entries along dim "
            f"{spec.dim}, but its shard layout expects {spec.full_size}"
        )
    parts = [full.narrow(spec.dim, start, n) for start, n in spec.segments]
    return torch.cat(parts, dim=spec.dim).contiguous()


def assemble(pieces: list[torch.Tensor], specs: list[ShardSpec]) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order) and layout; inverse of `take`."""
    spec0 = specs[0]
    shape = list(pieces[0].shape)
    shape[spec0.dim] = spec0.full_size
    full = pieces[0].new_zeros(shape)
    covered = torch.zeros(spec0.full_size, dtype=torch.bool)
    for piece, spec in zip(pieces, specs, strict=True):
        offset = 0
        for start, n in spec.segments:
            full.narrow(spec.dim, start, n).copy_(piece.narrow(spec.dim, offset, n))
            covered[start : start + n] = True
            offset += n
    if not bool(covered.all()):
        raise ValueError(f"shard layouts {specs} do not cover all {spec0.full_size} entries of dim {spec0.dim}")
    return full
