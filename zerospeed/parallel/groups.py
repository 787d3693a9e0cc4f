"""DeepSpeed's `deepspeed.utils.groups` over zerospeed's rank grid and mesh.

DeepSpeed keeps its process groups in module globals and answers `_get_data_parallel_group()` & co. from
them. zerospeed passes a `ParallelMesh` explicitly (comm/mesh.py), so the layout questions here are answered
from the rank grid (pure: `_get_expert_parallel_ranks` is `RankGrid.groups("ep" / "edp")`, Note [expert
layout] in comm/topology.py), and the "this process" questions from the mesh given, or, without one, from
the plain data-parallel world of the job (the world is the data-parallel group, no model parallelism), which
is what DeepSpeed answers before any model-parallel groups are created. Nothing here creates a group.
"""

from __future__ import annotations

from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.comm.topology import RankGrid


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of a world laid out (pp, dp, tp), each a list of
    rank lists: every data-parallel group split into consecutive blocks of `expert_parallel_size_` ranks."""
    if use_data_before_expert_parallel_:
        raise ValueError(
            "use_data_before_expert_parallelism orders data-parallel ranks before expert-parallel ones; "
            "zerospeed lays out experts inside each data-parallel group only (Note [expert layout])"
        )
    grid = RankGrid.for_world(
        world_size, pp=pipeline_parallel_size_, tp=tensor_parallel_size_, ep=expert_parallel_size_
    )
    return grid.groups("ep"), grid.groups("edp")


_WORLD_AXES = ("dp", "edp", "dp_sp", "world")
"""Without a mesh the job is plain data parallel: these axes span the world, the others are this rank alone."""


def _axis_size(axis: str, mesh: ParallelMesh | None) -> int:
    if mesh is not None:
        return mesh.size(axis)
    return _get_world_size() if axis in _WORLD_AXES else 1


def _axis_rank(axis: str, mesh: ParallelMesh | None) -> int:
    if mesh is not None:
        return mesh.rank_in(axis)
    return _get_global_rank() if axis in _WORLD_AXES else 0


def _get_data_parallel_group(mesh: ParallelMesh | None = None):
    """The data-parallel process group of this rank (None: the world group)."""
    return None if mesh is None else mesh.group("dp")


def _get_data_parallel_world_size(mesh: ParallelMesh | None = None) -> int:
    return _axis_size("dp", mesh)


def _get_data_parallel_rank(mesh: ParallelMesh | None = None) -> int:
    return _axis_rank("dp", mesh)


def _get_model_parallel_world_size(mesh: ParallelMesh | None = None) -> int:
    return _axis_size("tp", mesh)


def _get_model_parallel_rank(mesh: ParallelMesh | None = None) -> int:
    return _axis_rank("tp", mesh)


def _get_sequence_parallel_world_size(mesh: ParallelMesh | None = None) -> int:
    return _axis_size("sp", mesh)


def _get_sequence_parallel_rank(mesh: ParallelMesh | None = None) -> int:
    return _axis_rank("sp", mesh)


def _get_expert_parallel_world_size(group_name: str | None = None, mesh: ParallelMesh | None = None) -> int:
    return _axis_size("ep", mesh)


def _get_expert_data_parallel_world_size(group_name: str | None = None, mesh: ParallelMesh | None = None) -> int:
    return _axis_size("edp", mesh)


def _get_world_size() -> int:
    return comm.get_world_size() if comm.is_initialized() else 1


def _get_global_rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0
