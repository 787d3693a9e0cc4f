"""The parallel layout as a pure rank grid.

Ranks are laid out as a C-order array of shape (pp, dp, sp, tp): tensor-parallel ranks are adjacent
(they talk the most), pipeline stages the farthest apart. Every query is integer arithmetic, so the
layout is tested without processes; `comm.groups` turns it into process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

AXES = ("pp", "dp", "sp", "tp")


@dataclass(frozen=True)
class RankGrid:
    pp: int = 1
    dp: int = 1
    sp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} size must be >= 1, got {getattr(self, axis)}")

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, sp: int = 1, tp: int = 1) -> "RankGrid":
        """The grid whose data-parallel size fills the rest of `world_size`."""
        other = pp * sp * tp
        if world_size % other:
            raise ValueError(f"world size {world_size} is not divisible by pp*sp*tp = {pp}*{sp}*{tp} = {other}")
        return cls(pp=pp, dp=world_size // other, sp=sp, tp=tp)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.sp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            out[axis] = rank % size
            rank //= size
        return {axis: out[axis] for axis in AXES}

    def rank(self, **coords: int) -> int:
        """Coordinates (missing axes = 0) -> rank."""
        rank = 0
        for axis, size in zip(AXES, self.shape):
            rank = rank * size + coords.get(axis, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ranks that differ only along `axis` (e.g. the data-parallel groups)."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        others = [a for a in AXES if a != axis]
        sizes = dict(zip(AXES, self.shape))
        groups = []
        for fixed in product(*(range(sizes[a]) for a in others)):
            base = dict(zip(others, fixed))
            groups.append([self.rank(**base, **{axis: i}) for i in range(sizes[axis])])
        return groups

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The group along `axis` that contains `rank`."""
        return next(g for g in self.groups(axis) if rank in g)
