"""The pieces of the stage-3 deferred host step that need no processes (Note [deferred tail] in
optim/sub_group_step.py): the optimizer snapshot a step still running after engine.step() steps, and
the stepper's tail against the sequential step_in_sub_groups."""

from __future__ import annotations

import pytest
import torch

from zerospeed.optim.sub_group_step import OverlappedStepper, snapshot_optimizer, step_in_sub_groups


def _adamw(lr=1e-2):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    return params, torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # (stepped first on purpose)
def test_snapshot_steps_its_own_hyperparameters_under_a_torch_lr_scheduler():
    params, opt = _adamw()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)  # wraps opt.step on the instance
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    host = snapshot_optimizer(opt)
    sched.step()  # the scheduler writes the next lr into the original's groups ...
    assert opt.param_groups[0]["lr"] == 5e-3 and host.param_groups[0]["lr"] == 1e-2
    for p in params:
        p.grad = torch.ones(5)
    host.step()  # ... the snapshot steps with the lr it was taken with, the hooks included
    ref_params, ref = _adamw()
    for p in ref_params:
        p.grad = torch.ones(5)
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert calls == ["pre"] and opt.state is host.state and len(opt.state) == 3


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_snapshot_keeps_a_tensor_lr_the_scheduler_fills_in_place():
    params = [torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    host = snapshot_optimizer(opt)
    sched.step()
    assert opt.param_groups[0]["lr"].item() == pytest.approx(5e-3) and host.param_groups[0][
        "lr"
    ].item() == pytest.approx(1e-2)


def test_tail_equals_the_sequential_step():
    sub_groups = [[0], [1, 2]]
    params, opt = _adamw()
    grads = [(p, torch.full((5,), float(i + 1))) for i, p in enumerate(params)]
    stepper = OverlappedStepper(sub_groups, threads=1)
    published = []
    assert stepper.start(opt, grads, 0.5, sub_groups, published.extend)
    opt.param_groups[0]["lr"] = 123.0  # what an LR scheduler does right after engine.step()
    stepper.finish(1)
    assert published == [1, 2] and stepper.in_flight
    zeroed = []
    stepper.then(lambda: zeroed.append(True))
    stepper.finish_all()
    assert published == [1, 2, 0] and zeroed == [True] and not stepper.in_flight
    stepper.close()
    ref_params, ref = _adamw()
    step_in_sub_groups(ref, [(p, torch.full((5,), float(i + 1))) for i, p in enumerate(ref_params)], 0.5, sub_groups)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
