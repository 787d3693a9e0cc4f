"""The parallel mesh without processes: the rank layout against an independent numpy layout, DeepSpeed's
literal expert-group and topology examples, the single layout error, and a one-rank mesh."""

from itertools import product

import numpy as np
import pytest
from torch import nn

from zerospeed.comm import MESH_AXES, ParallelMesh, RankGrid, layout_problems
from zerospeed.comm.mpu import expert_size
from zerospeed.parallel.pipeline import LayerSpec, PipelineModule
from zerospeed.parallel.pipeline.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from zerospeed.utils.errors import ConfigError


def _shapes(max_world=16):
    for pp, dp, sp, tp in product(range(1, max_world + 1), repeat=4):
        if pp * dp * sp * tp <= max_world:
            for ep in (e for e in range(1, dp * sp + 1) if dp * sp % e == 0):  # ep splits dp x sp
                yield pp, dp, sp, tp, ep


SHAPES = list(_shapes())


def _rows(array, axes):
    """Rank groups of a numpy rank array: the ranks varying along `axes`, one row per other index."""
    moved = np.moveaxis(array, axes, list(range(-len(axes), 0)))
    return sorted(sorted(row.tolist()) for row in moved.reshape(-1, int(np.prod([array.shape[a] for a in axes]))))


def _expected_groups(pp, dp, sp, tp, ep):
    """Each axis' groups from numpy reshapes: the grid (pp, dp, sp, tp), and dp x sp (adjacent in C order)
    split into (edp, ep), so the index d * sp + s = edp * ep + e."""
    ranks = np.arange(pp * dp * sp * tp).reshape(pp, dp, sp, tp)
    experts = ranks.reshape(pp, dp * sp // ep, ep, tp)  # axes: pp edp ep tp
    return {
        "pp": _rows(ranks, [0]),
        "dp": _rows(ranks, [1]),
        "sp": _rows(ranks, [2]),
        "tp": _rows(ranks, [3]),
        "ep": _rows(experts, [2]),
        "edp": _rows(experts, [1]),
        "dp_sp": _rows(ranks, [1, 2]),
        "mp": _rows(ranks, [3]),
        "world": [list(range(ranks.size))],
    }


def test_shapes_cover_many_layouts():
    assert len(SHAPES) > 300 and (2, 2, 2, 2, 2) in SHAPES and (1, 16, 1, 1, 4) in SHAPES


def test_groups_match_an_independent_layout():
    for shape in SHAPES:
        grid = RankGrid(*shape)
        expected = _expected_groups(*shape)
        for axis in MESH_AXES:
            groups = grid.groups(axis)
            assert sorted(groups) == expected[axis], (shape, axis)
            assert all(g == sorted(g) for g in groups), (shape, axis)  # group rank = index in sorted ranks (torch)
            assert sorted(r for g in groups for r in g) == list(range(grid.world_size)), (shape, axis)  # partition
            assert len({len(g) for g in groups}) == 1, (shape, axis)


def test_coordinates_match_an_independent_layout():
    for pp, dp, sp, tp, ep in SHAPES:
        grid = RankGrid(pp=pp, dp=dp, sp=sp, tp=tp, ep=ep)
        for rank in range(grid.world_size):
            p, d, s, t = np.unravel_index(rank, (pp, dp, sp, tp))
            _, edp, e, _ = np.unravel_index(rank, (pp, dp * sp // ep, ep, tp))
            assert grid.coords(rank) == {"pp": p, "dp": d, "sp": s, "tp": t}, (grid, rank)
            assert grid.expert_coords(rank) == {"ep": e, "edp": edp}, (grid, rank)
            assert grid.rank(**grid.coords(rank)) == rank
            assert grid.group_of(rank, "ep").index(rank) == e and grid.group_of(rank, "edp").index(rank) == edp


def test_expert_groups_match_deepspeed_examples():
    # DeepSpeed's _create_expert_and_data_parallel docstring: world 8 (16 there), ep 2
    grid = RankGrid.for_world(8, ep=2)
    assert grid.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.groups("dp") == [list(range(8))]
    # with tensor parallelism the data-parallel groups are strided and each is split the same way
    grid = RankGrid.for_world(8, tp=2, ep=2)
    assert grid.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert grid.groups("edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    # DeepSpeed's _get_expert_parallel_ranks docstring: world 16, model degree 2, expert degree 4
    grid = RankGrid.for_world(16, tp=2, ep=4)
    assert grid.groups("ep") == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert grid.groups("edp") == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


def test_derived_axes():
    grid = RankGrid(pp=2, dp=2, sp=2, tp=2)
    assert grid.groups("dp_sp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert grid.groups("mp") == grid.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert grid.groups("world") == [list(range(16))]
    assert RankGrid(dp=4).with_ep(2).groups("ep") == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        grid.groups("xp")


def _assert_lists(message, problems):
    assert f"the parallel layout has {len(problems)} problems:" in message
    for problem in problems:
        assert f"  - {problem}" in message


def test_one_error_lists_every_violation():
    with pytest.raises(ValueError) as err:
        RankGrid(pp=0, dp=4, tp=-1, ep=3)
    _assert_lists(
        str(err.value),
        [
            "pp size must be >= 1, got 0: use 1 to leave the pp axis unsplit",
            "tp size must be >= 1, got -1: use 1 to leave the tp axis unsplit",
            "ep=3 does not divide the data-parallel size dp=4: expert-parallel groups split each data-parallel "
            "group, so choose ep among [1, 2, 4]",
        ],
    )
    with pytest.raises(ValueError) as err:
        RankGrid.for_world(12, pp=5, ep=0)
    _assert_lists(
        str(err.value),
        [
            "ep size must be >= 1, got 0: use 1 to leave the ep axis unsplit",
            "world size 12 is not divisible by pp*sp*tp = 5*1*1 = 5: run on a multiple of 5 ranks, or choose "
            "pp*sp*tp among the divisors of 12: [1, 2, 3, 4, 6, 12]",
        ],
    )
    with pytest.raises(ValueError) as err:
        RankGrid.for_world(8, sp=2.0, tp="2")
    _assert_lists(
        str(err.value),
        [
            "sp size must be an integer, got 2.0: pass a whole number such as 1 or 2",
            "tp size must be an integer, got '2': pass a whole number such as 1 or 2",
        ],
    )


def test_layout_problems_single_and_none():
    assert layout_problems(world_size=16, pp=2, tp=2, ep=4) == []
    assert layout_problems(world_size=8, pp=2, dp=2, tp=1) == [
        "pp*dp*sp*tp = 2*2*1*1 = 4 ranks but the world has 8: leave dp out to let data parallelism fill the rest"
    ]
    with pytest.raises(ValueError, match=r"^ep=2 does not divide the data-parallel size dp=3"):
        RankGrid.for_world(12, pp=2, tp=2, ep=2)


def test_build_reports_every_violation_at_once():
    with pytest.raises(ValueError) as err:
        ParallelMesh.build(tp=3, ep=0, world_size=2)
    _assert_lists(
        str(err.value),
        [
            "world_size=2 but the job has 1 ranks: launch 2 processes or leave world_size out",
            "ep size must be >= 1, got 0: use 1 to leave the ep axis unsplit",
            "world size 1 is not divisible by pp*sp*tp = 1*1*3 = 3: run on a multiple of 3 ranks, or choose "
            "pp*sp*tp among the divisors of 1: [1]",
        ],
    )


def test_one_rank_mesh():
    for mesh in (ParallelMesh.build(), ParallelMesh.data_parallel(), ParallelMesh.build(world_size=1)):
        assert mesh.grid == RankGrid()
        assert mesh.coords == {"pp": 0, "dp": 0, "sp": 0, "tp": 0, "ep": 0, "edp": 0}
        for axis in MESH_AXES:
            assert (mesh.group(axis), mesh.size(axis), mesh.rank_in(axis), mesh.members(axis)) == (None, 1, 0, [0])
        assert mesh.expert_parallel_group(1) is None and mesh.expert_data_parallel_group(1) is None
    with pytest.raises(ValueError, match="unknown parallel axis 'data'"):
        mesh.size("data")
    with pytest.raises(ValueError, match="ep=2 does not divide the data-parallel size dp=1"):
        mesh.expert_parallel_group(2)


def test_mpu_adapter_round_trip_on_one_rank():
    mpu = ParallelMesh.build().as_mpu()
    for kind in ("data", "model", "tensor_model", "pipeline_model", "pipe", "sequence", "sequence_data"):
        assert getattr(mpu, f"get_{kind}_parallel_group")() is None
        assert getattr(mpu, f"get_{kind}_parallel_world_size")() == 1
        assert getattr(mpu, f"get_{kind}_parallel_rank")() == 0
    assert mpu.get_expert_parallel_group("ep_size_1") is None
    assert mpu.get_expert_data_parallel_world_size("ep_size_1") == 1
    mesh = ParallelMesh.from_mpu(mpu)
    assert mesh.grid is None and mesh.coords is None
    assert all(mesh.size(axis) == 1 and mesh.members(axis) == [0] for axis in MESH_AXES)


class _MegatronStyleMpu:
    def get_data_parallel_group(self):
        return None

    def get_tensor_model_parallel_group(self):
        return None

    def get_tensor_model_parallel_world_size(self):
        return 2  # disagrees with its group


def test_from_mpu_errors():
    with pytest.raises(TypeError, match="object is not an mpu: it has no get_data_parallel_group()"):
        ParallelMesh.from_mpu(object())
    with pytest.raises(
        ValueError,
        match=r"mpu.get_tensor_model_parallel_world_size\(\)/rank\(\) say 2/0 but its "
        "group has 1 ranks",
    ):
        ParallelMesh.from_mpu(_MegatronStyleMpu())


def test_expert_group_names():
    assert expert_size("ep_size_4") == 4 and expert_size(2) == 2
    with pytest.raises(ValueError, match="'ep4' is not DeepSpeed's 'ep_size_<N>'"):
        expert_size("ep4")


# -- DeepSpeed's ProcessTopology ----------------------------------------------------------------------


def test_pipe_model_data_topology_matches_deepspeed_examples():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == 8
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("sequence") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    coord = topo.get_coord(3)
    assert coord == topo.ProcessCoord(pipe=0, data=1, model=1) and (coord.pipe, coord.data, coord.model) == (0, 1, 1)
    assert topo.get_rank_repr(5) == "model_01"
    assert topo.get_rank_repr(5, omit_axes=[], inner_sep="=", outer_sep="/") == "pipe=01/data=00/model=01"
    assert topo.get_dim("data") == 2 and topo.get_dim("sequence") == 0


def test_process_topology_docstring_examples():
    xy = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert xy.get_rank(x=0, y=1) == 1 and xy.get_dim("y") == 3
    assert xy.get_coord(rank=1).x == 0 and xy.get_coord(rank=1).y == 1
    assert xy.get_axis_list(axis="x", idx=0) == [0, 1, 2] and xy.get_axis_list(axis="y", idx=0) == [0, 3]
    ab = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert ab.get_rank_repr(rank=3) == "a_01-b_01" and ab.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"
    with pytest.raises(ValueError, match="does not support slices, use filter_match"):
        xy.get_rank(x=0)
    with pytest.raises(ValueError, match="rank 6 not found in topology"):
        xy.get_coord(6)
    with pytest.raises(ValueError, match="must pair up"):
        ProcessTopology(["x", "x"], [1, 2])


@pytest.mark.parametrize("num_pp, num_mp, num_dp", [(2, 2, 2), (1, 4, 2), (3, 1, 2), (2, 2, 1)])
def test_topology_to_grid_is_the_same_layout(num_pp, num_mp, num_dp):
    topo = PipeModelDataParallelTopology(num_pp=num_pp, num_mp=num_mp, num_dp=num_dp)
    grid = topo.to_grid()
    assert grid == RankGrid(pp=num_pp, dp=num_dp, tp=num_mp)
    for rank in range(topo.world_size()):
        coord = topo.get_coord(rank)
        assert grid.coords(rank) == {"pp": coord.pipe, "dp": coord.data, "sp": 0, "tp": coord.model}
    for axis, grid_axis in (("pipe", "pp"), ("data", "dp"), ("model", "tp")):
        assert topo.get_axis_comm_lists(axis) == grid.groups(grid_axis)
    assert PipeDataParallelTopology(num_pp=2, num_dp=4).to_grid() == RankGrid(pp=2, dp=4)


def test_topology_without_grid_equivalent():
    assert ProcessTopology(["data", "pipe"], [1, 2]).to_grid() == RankGrid(pp=2)  # size-1 axes may go anywhere
    with pytest.raises(ValueError, match=r"topology axes \['data', 'pipe'\] \(dims \[2, 2\]\) have no RankGrid"):
        ProcessTopology(["data", "pipe"], [2, 2]).to_grid()


def test_deepspeed_paths_export_the_topologies():
    import zerospeed.parallel.pipeline.topology as ds_path
    import zerospeed.pipe

    for name in ("ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"):
        assert getattr(zerospeed.pipe, name) is getattr(ds_path, name)


def test_pipeline_module_takes_a_deepspeed_topology():
    module = PipelineModule([LayerSpec(nn.Linear, 2, 2)], topology=PipeDataParallelTopology(num_pp=1, num_dp=1))
    assert module.grid == RankGrid() and module.groups.mesh.grid == RankGrid()
    with pytest.raises(ConfigError, match=r"topology \(1, 1, 1, 2\) has 2 ranks but the job has 1"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], topology=PipeModelDataParallelTopology(1, 2, 1))
    with pytest.raises(ConfigError, match="PipelineModule: topology axes"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], topology=ProcessTopology(["data", "pipe"], [2, 2]))
