"""DeepSpeed LR schedulers: values at chosen steps computed by hand from the documented formulas."""

import math

import pytest
import torch

from zerospeed.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerospeed.optim import lr_formulas as F
from zerospeed.utils.errors import ConfigError

approx = pytest.approx


def sgd(lr=1.0, momentum=0.5, groups=1):
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.ones(1))]} for _ in range(groups)], lr=lr, momentum=momentum
    )


def adam(lr=1.0, betas=(0.9, 0.95)):
    return torch.optim.Adam([torch.nn.Parameter(torch.ones(1))], lr=lr, betas=betas)


def lrs_at(scheduler, steps):
    """Step the scheduler and record the optimizer's lr after reaching each listed iteration."""
    out = {}
    for it in range(max(steps) + 1):
        scheduler.step()
        assert scheduler.last_batch_iteration == it
        if it in steps:
            out[it] = scheduler.optimizer.param_groups[0]["lr"]
    return out


# ---------------------------------------------------------------- WarmupLR


def test_warmup_lr_log():
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01  # written at construction (step -1)
    assert sched.get_last_lr() == [0.01]
    got = lrs_at(sched, [0, 1, 4, 9, 10, 100])
    assert got[0] == approx(0.01)  # log(1) = 0
    assert got[1] == approx(0.01 + 0.1 * math.log(2) / math.log(10))
    assert got[4] == approx(0.01 + 0.1 * math.log(5) / math.log(10))
    assert got[9] == approx(0.11)
    assert got[10] == approx(0.11) and got[100] == approx(0.11)
    assert sched.get_last_lr() == [got[100]]


def test_warmup_lr_linear():
    sched = WarmupLR(sgd(), warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=10, warmup_type="linear")
    got = lrs_at(sched, [0, 1, 5, 9, 10, 50])
    assert got == approx({0: 0.01, 1: 0.02, 5: 0.06, 9: 0.10, 10: 0.11, 50: 0.11})


def test_warmup_lr_one_step_warms_over_two():
    sched = WarmupLR(sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)
    assert lrs_at(sched, [0, 1, 2]) == approx({0: 0.0, 1: 1.0, 2: 1.0})


def test_warmup_lr_max_defaults_to_each_groups_lr_and_lists_per_group():
    opt = sgd(lr=0.4, groups=2)
    opt.param_groups[1]["lr"] = 0.8
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.2]
    sched.step(last_batch_iteration=2)  # jump: 2/4 of the way
    assert sched.get_last_lr() == approx([0.2, 0.2 + 0.6 * 0.5])
    assert sched.get_lr() == sched.get_last_lr()


def test_warmup_lr_list_length_mismatch():
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_max_lr: expected 2 values .*got 3"):
        WarmupLR(sgd(groups=2), warmup_max_lr=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_warmup_num_steps_must_be_positive_int(steps):
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps: must be a positive integer"):
        WarmupLR(sgd(), warmup_num_steps=steps)


def test_unknown_warmup_type_warms_up_as_log_with_a_warning(caplog):
    # DeepSpeed 0.19.8 logs "Using unknown warmup_type" and falls back to log (tests/unit/test_deepspeed_fidelity.py)
    with caplog.at_level("WARNING"):
        sched = WarmupLR(sgd(), warmup_type="cosine", warmup_num_steps=10)
    assert "warmup_type 'cosine' is not one of ['log', 'linear']; warming up as 'log'" in caplog.text
    assert sched.warmup_type == "log"


# ---------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_linear():
    sched = WarmupDecayLR(
        sgd(), total_num_steps=30, warmup_min_lr=0.02, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"
    )
    got = lrs_at(sched, [0, 1, 5, 9, 10, 20, 25, 30, 40])
    # warmup: 0.02 + 0.08 * it/10; decay: 0.02 + 0.08 * (30 - it) / 20, floored at gamma 0.
    assert got == approx(
        {
            0: 0.02,
            1: 0.028,
            5: 0.06,
            9: 0.092,
            10: 0.1,
            20: 0.02 + 0.08 * 0.5,
            25: 0.02 + 0.08 * 0.25,
            30: 0.02,
            40: 0.02,
        }
    )


def test_warmup_decay_lr_log_warmup_then_decay_to_zero():
    sched = WarmupDecayLR(sgd(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=4)
    got = lrs_at(sched, [2, 4, 12, 19])
    assert got == approx({2: math.log(3) / math.log(4), 4: 1.0, 12: 0.5, 19: 1 / 16})


def test_warmup_decay_requires_total_num_steps_positive():
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps"):
        WarmupDecayLR(sgd(), total_num_steps=0)


# ---------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_lr_linear():
    opt = sgd(lr=0.5)
    sched = WarmupCosineLR(
        opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.01, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed's value before the first step
    got = lrs_at(sched, [0, 2, 3, 4, 11, 19, 50])
    # warmup ratio 0.1 + 0.9 * it/4; then progress (it - 4 + 1)/16 along the cosine.
    assert got[0] == approx(0.5 * 0.1)
    assert got[2] == approx(0.5 * 0.55)
    assert got[3] == approx(0.5 * 0.775)
    assert got[4] == approx(0.5 * (0.01 + 0.99 * (1 + math.cos(math.pi / 16)) / 2))
    assert got[11] == approx(0.5 * 0.505)
    assert got[19] == approx(0.5 * 0.01)
    assert got[50] == approx(0.5 * 0.01)  # held at the floor past the end


def test_warmup_cosine_lr_log_and_per_group_base_lrs():
    opt = sgd(lr=1.0, groups=2)
    opt.param_groups[1]["lr"] = 2.0
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_min_ratio=0.2, warmup_num_steps=4)
    sched.step(last_batch_iteration=2)
    ratio = 0.2 + 0.8 * math.log(3) / math.log(4)
    assert sched.get_last_lr() == approx([ratio, 2 * ratio])
    assert sched.get_lr_ratio() == approx(ratio)


# ---------------------------------------------------------------- OneCycle


def one_cycle(opt, **kw):
    args = dict(
        cycle_min_lr=0.1,
        cycle_max_lr=1.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_step_size=2,
        decay_lr_rate=0.5,
        decay_mom_rate=0.01,
    )
    args.update(kw)
    return OneCycle(opt, **args)


def test_one_cycle_lr_and_momentum_adam():
    opt = adam(betas=(0.9, 0.95))
    sched = one_cycle(opt)
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)  # cycle_min_mom, written at construction as DeepSpeed
    lr, mom = {}, {}
    for it in range(14):
        sched.step()
        lr[it], mom[it] = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]
    # batch = it + 1; scale = batch/4 climbing, (10 - batch)/6 descending.
    assert lr[0] == approx(0.1 + 1.0 * 1 / 4) and mom[0] == approx(0.9 - 0.1 * 1 / 4)
    assert lr[3] == approx(1.1) and mom[3] == approx(0.8)
    assert lr[5] == approx(0.1 + 1.0 * 4 / 6) and mom[5] == approx(0.9 - 0.1 * 4 / 6)
    assert lr[8] == approx(0.1 + 1.0 * 1 / 6)
    assert lr[9] == approx(0.1) and mom[9] == approx(0.9)
    # decay: d = it - 10 + 1; lr = 0.1 / (1 + 0.5 * d/2); mom = 0.9 * (1 + 0.01 * d/2).
    assert lr[10] == approx(0.1 / 1.25) and mom[10] == approx(0.9 * 1.005)
    assert lr[13] == approx(0.1 / 2.0) and mom[13] == approx(0.9 * 1.02)
    assert opt.param_groups[0]["betas"][1] == 0.95


def test_one_cycle_sgd_cycles_the_lr_and_leaves_momentum_as_deepspeed(caplog):
    opt = sgd(momentum=0.5)
    with caplog.at_level("WARNING"):
        sched = one_cycle(opt)
    assert "cycle_momentum is disabled: SGD has no 'betas'" in caplog.text
    assert sched.get_mom() is None
    sched.step()
    assert opt.param_groups[0]["lr"] == approx(0.35) and opt.param_groups[0]["momentum"] == 0.5


def test_one_cycle_adam_writes_betas0_and_keeps_betas1():
    opt = adam(betas=(0.9, 0.95))
    sched = one_cycle(opt)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    sched.step()
    sched.step()
    assert opt.param_groups[0]["betas"] == (approx(0.9 - 0.1 * 2 / 4), 0.95)
    assert sched.get_mom() == [(approx(0.85), 0.95)]


def test_one_cycle_without_decay_holds_min_lr_and_max_mom():
    opt = adam()
    sched = one_cycle(opt, decay_step_size=0)
    sched.step(last_batch_iteration=25)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_one_cycle_stairs():
    opt = sgd()
    sched = one_cycle(opt, cycle_first_stair_count=2)  # second half inherits 2 stairs
    got = lrs_at(sched, [0, 1, 2, 3, 4, 5, 7])
    # first half: floor(batch*2/4)/2; second: floor((10-batch)*2/6)/2.
    assert got == approx({0: 0.1, 1: 0.6, 2: 0.6, 3: 1.1, 4: 0.6, 5: 0.6, 7: 0.1})


def test_one_cycle_momentum_disabled_for_optimizers_without_it(caplog):
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    with caplog.at_level("WARNING"):
        sched = one_cycle(opt)
    assert "cycle_momentum is disabled" in caplog.text
    assert sched.get_mom() is None
    sched.step()
    assert opt.param_groups[0]["lr"] == approx(0.35)


def test_one_cycle_bad_step_size():
    with pytest.raises(ConfigError, match="scheduler.params.cycle_first_step_size"):
        one_cycle(sgd(), cycle_first_step_size=0)


# ---------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous_and_staircase():
    opt = sgd()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 0.01
    # lr = 0.01 * (1 + 2 * (it + 1) / 10)
    assert lrs_at(sched, [0, 4, 19]) == approx({0: 0.012, 4: 0.02, 19: 0.05})
    stairs = LRRangeTest(
        sgd(),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=10,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    assert lrs_at(stairs, [0, 8, 9, 19]) == approx({0: 0.01, 8: 0.01, 9: 0.03, 19: 0.05})


# ---------------------------------------------------------------- shared behaviour


def make_all(opt_factory):
    return [
        WarmupLR(opt_factory(), warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=5),
        WarmupDecayLR(opt_factory(), total_num_steps=12, warmup_max_lr=0.3, warmup_num_steps=5),
        WarmupCosineLR(opt_factory(), total_num_steps=12, warmup_num_steps=5),
        one_cycle(opt_factory(), cycle_first_stair_count=3),
        LRRangeTest(opt_factory(), lr_range_test_step_size=3),
    ]


def test_state_dict_round_trip_continues_identically():
    for ref, fresh in zip(make_all(adam), make_all(adam)):
        for _ in range(7):
            ref.step()
        state = ref.state_dict()
        assert state == {"last_batch_iteration": 6}
        fresh.load_state_dict(state)
        for _ in range(8):
            ref.step()
            fresh.step()
            assert fresh.get_last_lr() == ref.get_last_lr()
            assert fresh.optimizer.param_groups[0]["betas"] == ref.optimizer.param_groups[0]["betas"]


def test_resuming_with_last_batch_iteration_leaves_optimizer_until_step():
    opt = sgd(lr=0.7)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.7
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        sched.get_last_lr()
    sched.step()
    assert sched.get_last_lr() == [approx(math.log(6) / math.log(10))]


def test_step_accepts_deepspeeds_batch_iteration_name():
    sched = LRRangeTest(sgd(), lr_range_test_min_lr=0.01, lr_range_test_step_size=10)
    sched.step(batch_iteration=9)
    assert sched.last_batch_iteration == 9 and sched.get_last_lr() == [approx(0.02)]
    with pytest.raises(TypeError, match="not both"):
        sched.step(3, batch_iteration=4)


def test_tensor_lr_is_updated_in_place():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_min_lr=0.125, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == approx(0.125 + 0.375 * 1 / 4)


def test_wrapper_with_inner_optimizer_is_accepted():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    inner = sgd()
    sched = WarmupLR(Wrapper(inner), warmup_min_lr=0.3)
    assert sched.optimizer is inner and inner.param_groups[0]["lr"] == 0.3
    with pytest.raises(TypeError, match="no param_groups"):
        WarmupLR(object())


# ---------------------------------------------------------------- pure formulas


def test_formulas_directly():
    assert F.warmup_gamma(3, 8, "linear") == 3 / 8
    assert F.warmup_lr(-1, 0.2, 1.0, 8) == 0.2
    assert F.warmup_decay_gamma(15, 5, 15) == 0.0
    assert F.warmup_cosine_ratio(-1, 10) == 0.0
    assert F.one_cycle_scale(1, 4, 6) == 0.4999999999999999  # DeepSpeed's float arithmetic, to the bit
    assert F.one_cycle_scale(1, 4, 4) == 2 / 4
    assert F.one_cycle_scale(6, 4, 6, 0, 3) == 1 / 3  # batch 7: distance 3, floor(3*3/6)/3
    assert F.one_cycle_momentum(3, 0.8, 0.9, 4, 4) == approx(0.8)
    assert F.lr_range_test_lr(-1, 0.5, 7) == 0.5
    with pytest.raises(ValueError, match="warmup_type"):
        F.warmup_gamma(0, 5, "exp")


def test_stair_boundaries_are_exact():
    # 3 stairs over 9 steps: an integer floor reaches every stair exactly (no float 1-ulp miss).
    scales = [F.one_cycle_scale(it, 9, 9, 3, 3) for it in range(-1, 9)]
    assert scales == [0, 0, 0, 1 / 3, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 2 / 3, 1]
