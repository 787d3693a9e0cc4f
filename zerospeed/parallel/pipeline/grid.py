"""DeepSpeed's `PipelineParallelGrid` (`deepspeed.runtime.pipe.topology`): a topology's mesh, as an mpu.

DeepSpeed's grid takes a `ProcessTopology` and creates the process groups of its axes; zerospeed's
`ParallelMesh` already does exactly that for the topology's `RankGrid` (every group once, collective), and
`MeshMpu` already answers the `mpu` questions (`get_data_parallel_group()`, `get_pipe_parallel_rank()`, ...).
The grid adds DeepSpeed's stage vocabulary on top: the stage id, first / last stage, the rank lists of this
rank's pipeline and data groups, and `stage_to_global`.
"""

from __future__ import annotations

from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.comm.mpu import MeshMpu
from zerospeed.parallel.pipeline.topology import PipeDataParallelTopology, ProcessTopology


def _prime_factors(n: int) -> list[int]:
    """The prime factors of `n` >= 1, ascending, with repeats (1 -> [])."""
    if n < 1:
        raise ValueError(f"prime factors need a positive integer, got {n}")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


class PipelineParallelGrid(MeshMpu):
    """The process groups of `topology` (default: pure data parallelism over the world). Every rank must
    construct it together (it creates the groups)."""

    def __init__(self, topology: ProcessTopology | None = None, process_group=None) -> None:
        if process_group is not None:
            raise ValueError("PipelineParallelGrid(process_group=...) is not supported: the grid spans the world")
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self._topo = topology or PipeDataParallelTopology(num_pp=1, num_dp=self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"topology of {self._topo.world_size()} ranks in a world of {self.world_size}")
        super().__init__(ParallelMesh.from_grid(self._topo.to_grid()))
        self.data_parallel_size = self.mesh.size("dp")
        self.pipe_parallel_size = self.mesh.size("pp")
        self.model_parallel_size = self.mesh.size("tp")
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.pp_group = self.mesh.members("pp")
        self.dp_group = self.mesh.members("dp")

    def get_stage_id(self) -> int:
        return self.mesh.rank_in("pp")

    def get_data_parallel_id(self) -> int:
        return self.mesh.rank_in("dp")

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def topology(self) -> ProcessTopology:
        return self._topo

    def _is_grid_valid(self) -> bool:
        """Every rank sits in exactly one group per axis and the groups cover the world."""
        sizes = [self.mesh.size(axis) for axis in ("pp", "dp", "tp")]
        return sizes[0] * sizes[1] * sizes[2] * self.mesh.size("sp") == self.world_size

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of pipeline stage `stage_id` at this rank's other coordinates (or those given)."""
        me = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coords)
        return self._topo.get_rank(**me._asdict())
