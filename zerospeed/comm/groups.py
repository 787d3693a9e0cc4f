"""Process groups for a RankGrid: built once, passed explicitly (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass, field

from zerospeed.comm import backend
from zerospeed.comm.topology import AXES, RankGrid


@dataclass
class ParallelGroups:
    """This rank's process group (and its member ranks) along each axis of the grid."""

    grid: RankGrid
    rank: int
    members: dict[str, list[int]] = field(default_factory=dict)
    handles: dict[str, object] = field(default_factory=dict)

    @classmethod
    def build(cls, grid: RankGrid) -> "ParallelGroups":
        """Create every group of every axis (all ranks must call this together)."""
        rank = backend.get_rank()
        if grid.world_size != backend.get_world_size():
            raise ValueError(f"rank grid {grid.shape} has {grid.world_size} ranks but the job has "
                             f"{backend.get_world_size()}")
        out = cls(grid=grid, rank=rank)
        for axis in AXES:
            for ranks in grid.groups(axis):
                # The world group serves an axis that spans every rank; new_group is collective
                # and must be entered by all ranks for every group, in the same order.
                handle = None if len(ranks) == grid.world_size else backend.new_group(ranks)
                if rank in ranks:
                    out.members[axis], out.handles[axis] = ranks, handle
        return out

    def group(self, axis: str):
        return self.handles[axis]

    def size(self, axis: str) -> int:
        return len(self.members[axis])

    def rank_in(self, axis: str) -> int:
        return self.members[axis].index(self.rank)
