"""ZenFlow's pure parts: the column sums over cut matrices, the top columns, the "auto" interval and the
config's translation into a `ZenFlowPlan` (DeepSpeed's checks), against formulas written here."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import ConfigError, parse_config
from zerospeed.offload.zenflow import AutoInterval, ZenFlowPlan, matrix_shape, top_columns
from zerospeed.runtime.plans import zenflow_plan
from zerospeed.zero.zenflow import add_column_sums


@pytest.mark.parametrize("rows,cols", [(5, 7), (1, 9), (4, 4), (3, 1)])
def test_column_sums_of_any_cut_equal_the_matrix_column_sums(rows, cols):
    torch.manual_seed(rows * cols)
    w = torch.randn(rows, cols, dtype=torch.float64)
    n = rows * cols
    for cuts in ([0, n], [0, 1, n], [0, 2, min(9, n), n], list(range(n + 1))):
        cuts = sorted(set(cuts))
        sums = torch.zeros(cols, dtype=torch.float64)
        for a, b in zip(cuts, cuts[1:]):
            add_column_sums(sums, w.reshape(-1)[a:b], a)
        torch.testing.assert_close(sums, w.sum(dim=0))


def test_top_columns_and_matrix_shapes():
    assert top_columns(torch.tensor([0.5, 3.0, 1.0, 2.0]), 0.5).tolist() == [1, 3]
    assert top_columns(torch.tensor([1.0, 2.0, 3.0]), 0.2).numel() == 0  # int(0.6) columns
    assert matrix_shape(torch.Size([4, 3, 2])) == (4, 6, False)
    assert matrix_shape(torch.Size([7])) == (1, 7, True)


def test_auto_interval_ends_when_enough_matrices_caught_up():
    auto = AutoInterval(n_matrices=2, topk_ratio=0.25, auto_ratio=0.5)
    # matrix 0: selected 1, total 2 per step -> rest 1/0.75 per step against a mean critic of 1/0.25 = 4
    assert not auto.observe([1.0, 1.0], [2.0, 1.5])  # 1.33 < 4, 0.67 < 4
    assert not auto.observe([1.0, 1.0], [2.0, 1.5])  # 2.67 < 4
    assert auto.observe([1.0, 1.0], [2.0, 1.5])  # 4.0 >= 4 for matrix 0: int(0.5 * 2) = 1 caught up
    auto.reset()
    assert auto.steps == 0 and not auto.observe([1.0, 1.0], [2.0, 1.5])
    assert AutoInterval(0, 0.1, 0.99).observe([], [])  # no matrices: the host steps every step


def _plan(**zf):
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    cfg["zero_optimization"]["zenflow"] = zf
    return zenflow_plan(parse_config(cfg))


def test_config_becomes_a_plan_with_deepspeeds_resolution():
    assert _plan() == ZenFlowPlan(select_interval=0, update_interval=0)  # "auto": select once, auto interval
    assert _plan(select_strategy="epoch", select_interval=2, steps_per_epoch=10).select_interval == 20
    plan = _plan(select_strategy="step", select_interval=8, update_interval=4, overlap_step=True)
    assert (plan.select_interval, plan.update_interval, plan.overlap_step, plan.auto_update) == (8, 4, True, False)


@pytest.mark.parametrize(
    "zf,message",
    [
        ({"select_interval": 3}, 'leave select_interval "auto"'),
        ({"select_strategy": "step"}, "needs a number as select_interval"),
        ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "must be at least update_interval"),
    ],
)
def test_deepspeeds_refusals(zf, message):
    with pytest.raises(ConfigError, match=message):
        _plan(**zf)
