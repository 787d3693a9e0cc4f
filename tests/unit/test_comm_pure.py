"""Pure communication math: the rank grid."""

import pytest

from zerospeed.comm import RankGrid


def test_grid_coords_and_rank_roundtrip():
    grid = RankGrid(pp=2, dp=2, sp=1, tp=2)
    assert grid.world_size == 8
    assert grid.coords(5) == {"pp": 1, "dp": 0, "sp": 0, "tp": 1}
    assert grid.coords(3) == {"pp": 0, "dp": 1, "sp": 0, "tp": 1}
    assert all(grid.rank(**grid.coords(r)) == r for r in range(8))


def test_grid_groups_along_each_axis():
    grid = RankGrid(pp=2, dp=2, tp=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.group_of(6, "dp") == [4, 6]
    assert grid.groups("sp") == [[r] for r in range(8)]


def test_grid_for_world_fills_data_parallel():
    assert RankGrid.for_world(12, pp=2, tp=3).shape == (2, 2, 1, 3)
    with pytest.raises(ValueError, match="not divisible by pp\\*sp\\*tp = 2\\*1\\*4 = 8"):
        RankGrid.for_world(12, pp=2, tp=4)
    with pytest.raises(ValueError, match="rank 8 outside world of size 8"):
        RankGrid(dp=8).coords(8)
    with pytest.raises(ValueError, match="dp size must be >= 1"):
        RankGrid(dp=0)
