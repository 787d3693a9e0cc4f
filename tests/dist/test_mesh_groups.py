"""The mesh's process groups on 4 gloo ranks: an all-reduce of the global rank over each axis' group
gives the sum of the pure layout's members, and an mpu round trip keeps every group."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.comm import MESH_AXES, ParallelMesh, RankGrid

WORLD = 4
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2)}


def _observe(group) -> tuple[float, int, int]:
    """(sum of the global ranks over `group`, its size, this rank's index in it), seen by torch."""
    total = torch.tensor([float(comm.get_rank())])
    comm.all_reduce(total, group=group)
    return total.item(), comm.get_world_size(group), comm.get_rank(group)


def _view(mesh: ParallelMesh, axis: str) -> dict:
    return {
        "members": mesh.members(axis),
        "size": mesh.size(axis),
        "rank_in": mesh.rank_in(axis),
        "torch": _observe(mesh.group(axis)),
    }


def _expert_view(mesh: ParallelMesh, ep_size: int) -> dict:
    ep, edp = mesh.expert_axes(ep_size)
    return {
        "ep": (list(ep.members), _observe(mesh.expert_parallel_group(ep_size))),
        "edp": (list(edp.members), _observe(mesh.expert_data_parallel_group(ep_size))),
    }


def _round_trip(mesh: ParallelMesh) -> dict:
    mpu = mesh.as_mpu()
    again = ParallelMesh.from_mpu(mpu)
    same = {
        axis: again.group(axis) is mesh.group(axis) and again.members(axis) == mesh.members(axis)
        for axis in ("pp", "dp", "sp", "tp", "mp", "dp_sp", "world")
    }
    named = {
        "tp": (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()),
        "dp": (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()),
        "ep2": _observe(mpu.get_expert_parallel_group("ep_size_2")),
    }
    return {"same": same, "named": named, "lazy_ep2": _expert_view(again, 2)}


def _mismatched_expert_sizes() -> str:
    mesh = ParallelMesh.data_parallel()
    try:
        mesh.expert_parallel_group(2 if comm.get_rank() < 2 else 4)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _mesh_worker() -> dict:
    out = {}
    for name, sizes in LAYOUTS.items():
        mesh = ParallelMesh.build(**sizes)
        out[name] = {
            "coords": mesh.coords,
            "axes": {axis: _view(mesh, axis) for axis in MESH_AXES},
            "ep4": _expert_view(mesh, 4) if name == "ep2" else None,
            "mpu": _round_trip(mesh),
        }
    out["mismatch"] = _mismatched_expert_sizes()
    return out


def _check_axis(view: dict, grid: RankGrid, rank: int, axis: str) -> None:
    members = grid.group_of(rank, axis)
    assert view["members"] == members and view["size"] == len(members)
    assert view["rank_in"] == members.index(rank)
    assert view["torch"] == (float(sum(members)), len(members), members.index(rank))


def _check_expert(view: dict, grid: RankGrid, rank: int) -> None:
    for axis in ("ep", "edp"):
        members, seen = view[axis]
        assert members == grid.group_of(rank, axis)
        assert seen == (float(sum(members)), len(members), members.index(rank))


@pytest.mark.timeout(90)
def test_mesh_groups_reduce_over_their_members():
    results = run_distributed(_mesh_worker, WORLD, timeout=60)
    for rank, result in enumerate(results):
        for name, sizes in LAYOUTS.items():
            grid, got = RankGrid.for_world(WORLD, **sizes), result[name]
            assert got["coords"] == {**grid.coords(rank), **grid.expert_coords(rank)}
            for axis in MESH_AXES:
                _check_axis(got["axes"][axis], grid, rank, axis)
            if got["ep4"] is not None:
                _check_expert(got["ep4"], grid.with_ep(4), rank)
            assert all(got["mpu"]["same"].values()), got["mpu"]["same"]
            assert got["mpu"]["named"]["tp"] == (grid.tp, grid.coords(rank)["tp"])
            assert got["mpu"]["named"]["dp"] == (grid.dp, grid.coords(rank)["dp"])
            ep2 = grid.with_ep(2)
            assert got["mpu"]["named"]["ep2"][0] == float(sum(ep2.group_of(rank, "ep")))
            _check_expert(got["mpu"]["lazy_ep2"], ep2, rank)
        assert "different sizes at the same point: [2, 2, 4, 4] (by rank)" in result["mismatch"]
