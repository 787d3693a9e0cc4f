"""build_lr_scheduler: DeepSpeed names (case-sensitive), torch schedulers, client schedulers, errors."""

import pytest
import torch

from zerospeed.optim import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_lr_scheduler
from zerospeed.utils.errors import ConfigError


def sgd(lr=0.5):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=lr, momentum=0.9)


def test_none_when_nothing_configured():
    assert build_lr_scheduler(None, None, sgd()) is None


def test_deepspeed_schedulers_by_name():
    opt = sgd()
    sched = build_lr_scheduler("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2}, opt)
    assert type(sched) is WarmupLR and opt.param_groups[0]["lr"] == 0.1
    sched = build_lr_scheduler("WarmupDecayLR", {"total_num_steps": 100}, sgd())
    assert type(sched) is WarmupDecayLR and sched.max_lrs == [0.001]
    assert type(build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 10}, sgd())) is WarmupCosineLR
    sched = build_lr_scheduler("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, sgd())
    assert type(sched) is OneCycle and sched.first_step_size == 2000


def test_torch_scheduler_by_name():
    opt = sgd(lr=1.0)
    sched = build_lr_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert type(sched) is torch.optim.lr_scheduler.StepLR
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_torch_scheduler_gets_inner_optimizer_of_a_wrapper():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    inner = sgd()
    sched = build_lr_scheduler("ExponentialLR", {"gamma": 0.9}, Wrapper(inner))
    assert sched.optimizer is inner
    with pytest.raises(ConfigError, match="need a torch.optim.Optimizer"):
        build_lr_scheduler("ExponentialLR", {"gamma": 0.9}, object())


def test_names_are_case_sensitive_with_suggestion():
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler("warmuplr", {}, sgd())
    msg = str(info.value)
    assert "scheduler.type: unknown scheduler 'warmuplr'" in msg and "'WarmupLR'" in msg
    assert "OneCycle" in msg and "LRRangeTest" in msg  # the valid choices are listed


def test_torch_base_class_is_not_a_scheduler_choice():
    with pytest.raises(ConfigError, match="scheduler.type: unknown scheduler 'LRScheduler'"):
        build_lr_scheduler("LRScheduler", {}, sgd())


def test_unknown_param_named_with_accepted_list():
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler("WarmupLR", {"warmup_max_lr": 0.1, "warmup_steps": 10}, sgd())
    msg = str(info.value)
    assert msg.startswith("scheduler.params.warmup_steps: not accepted by WarmupLR")
    assert "'warmup_num_steps'" in msg and "'warmup_type'" in msg


def test_missing_required_param():
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps: required by WarmupDecayLR"):
        build_lr_scheduler("WarmupDecayLR", {"warmup_num_steps": 10}, sgd())
    with pytest.raises(ConfigError, match="scheduler.params.cycle_min_lr, scheduler.params.cycle_max_lr: required"):
        build_lr_scheduler("OneCycle", {}, sgd())


def test_bad_values():
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        build_lr_scheduler("WarmupLR", {"warmup_num_steps": 0}, sgd())
    # an unknown warmup_type warms up as "log" with a warning, as in DeepSpeed (test_deepspeed_fidelity.py)
    assert build_lr_scheduler("WarmupLR", {"warmup_type": "exp"}, sgd()).warmup_type == "log"
    expected = "scheduler.params: LinearLR rejected .*'start_factor': 2.0.*multiplicative factor"
    with pytest.raises(ConfigError, match=expected):
        build_lr_scheduler("LinearLR", {"start_factor": 2.0}, sgd())


def test_client_scheduler_instance_and_callable_win():
    opt = sgd()
    client = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    assert build_lr_scheduler("WarmupLR", {}, opt, client) is client
    seen = []

    def make(o):
        seen.append(o)
        return WarmupLR(o, warmup_min_lr=0.2)

    sched = build_lr_scheduler(None, None, opt, make)
    assert seen == [opt] and type(sched) is WarmupLR and opt.param_groups[0]["lr"] == 0.2
