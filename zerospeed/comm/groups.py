"""`ParallelGroups`: the grid-axis view of a ParallelMesh that `PipelineModule` keeps as `.groups`."""

from __future__ import annotations

from zerospeed.comm.mesh import ParallelMesh
from zerospeed.comm.topology import AXES, RankGrid


class ParallelGroups:
    """This rank's process group (and its member ranks) along each axis of a RankGrid; see `mesh`."""

    def __init__(self, mesh: ParallelMesh):
        self.mesh = mesh

    @classmethod
    def build(cls, grid: RankGrid) -> ParallelGroups:
        """Create every group of every axis (all ranks must call this together)."""
        return cls(ParallelMesh.from_grid(grid))

    @property
    def grid(self) -> RankGrid:
        return self.mesh.grid

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def members(self) -> dict[str, list[int]]:
        """Global ranks of this rank's group along each grid axis."""
        return {axis: self.mesh.members(axis) for axis in AXES}

    def group(self, axis: str):
        return self.mesh.group(axis)

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def rank_in(self, axis: str) -> int:
        return self.mesh.rank_in(axis)
