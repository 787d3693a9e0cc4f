"""This rank's group along one axis (`AxisGroup`) and the collective maker of such groups (`GroupMaker`).

The bricks of `ParallelMesh` (comm/mesh.py), of the mpu adapter (comm/mpu.py) and of ZeRO++'s hpZ
sub-groups (comm/zeropp.py): a group is made by every rank together, in the same order, and a group
already made for the same ranks is reused (Note [size-1 axes] in comm/mesh.py for one-rank groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerospeed.comm import backend


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along one axis."""

    handle: Any
    """The process group; None means the world group."""
    size: int
    rank: int
    """This rank's index in the group."""
    members: tuple[int, ...]
    """The group's global ranks, in group-rank order."""

    @classmethod
    def of(cls, handle) -> AxisGroup:
        """This rank's view of a process group made elsewhere."""
        size = backend.get_world_size(handle)
        return cls(handle, size, backend.get_rank(handle), tuple(backend.global_rank(handle, i) for i in range(size)))


class GroupMaker:
    """Makes process groups collectively (every rank asks for every group, in the same order) and
    hands out this rank's. A group already made for the same ranks is reused, on every rank alike."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self._made: dict[tuple[int, ...], Any] = {}

    def axis(self, groups: list[list[int]]) -> AxisGroup:
        """This rank's group of `groups` (which partition the world), making all of them."""
        mine = tuple(next(g for g in groups if self.rank in g))
        if len(mine) == self.world:
            return AxisGroup(None, self.world, mine.index(self.rank), mine)
        if all(len(g) == 1 for g in groups):  # Note [size-1 axes]
            return AxisGroup(backend.SELF, 1, 0, mine)
        for ranks in groups:
            if tuple(ranks) not in self._made:
                self._made[tuple(ranks)] = backend.new_group(list(ranks))
        return AxisGroup(self._made[mine], len(mine), mine.index(self.rank), mine)

    def singletons(self) -> AxisGroup:
        return self.axis([[r] for r in range(self.world)])
