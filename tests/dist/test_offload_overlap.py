"""The overlapped CPU optimizer of plain offload (Note [overlapped step] in optim/sub_group_step.py).

`offload_optimizer.overlap_step` (zerospeed's own key, default true) steps each sub-group on a host
worker thread — during the boundary backward when the step's coefficient is known in advance (no
clipping, no loss scale), else from `engine.step()` on, pipelined with the copy back. Each case trains
the same 2-rank fp32 job with the overlap on and off: the losses and final weights must be bitwise
equal, and both must match a plain single-process PyTorch run with torch.optim.AdamW (<= 1e-5). The
last test shows the early start: the worker's first sub-group step begins before the backward's last
gradient is accumulated (timestamps of the stepper and of a gradient hook, not a sleep).
"""

from __future__ import annotations

import time

import pytest
import torch
from test_zero_parity import GAS, SCHED, build_model, global_batches, param_groups, zero_config

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from harness.reference import engine_global_step
from zerospeed import comm
from zerospeed.optim import build_lr_scheduler

STEPS = 4


def _config(stage, overlap, clip=0.0, params=False):
    cfg = zero_config(stage, gradient_clipping=clip)
    z = cfg["zero_optimization"]
    z["offload_optimizer"] = {"device": "cpu", "overlap_step": overlap}
    if params:
        z["offload_param"] = {"device": "cpu"}
    return cfg


def _train(config):
    model = build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    if hasattr(engine.zero.stepper, "copies_back"):
        # on this CPU-only machine a step that starts at engine.step() would run inline (nothing is
        # copied to a device); pipeline it anyway, so that path is checked here too
        engine.zero.stepper.copies_back = True
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = [engine_global_step(engine, batch, world, GAS, rank) for batch in global_batches(world, STEPS)]
    kind = type(engine.zero.stepper).__name__
    worked = len(getattr(engine.zero.stepper, "timeline", ()))  # the last step's events on the worker
    if engine.zero_optimization_stage() == 3:
        state = {k: v.float() for k, v in engine.zero.full_state_dict().items()}  # rank 0 only
    else:
        state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"losses": losses, "state": state, "stepper": kind, "worked": worked}


CASES = {  # name -> (stage, gradient_clipping, parameter offload)
    "stage1": (1, 0.0, False),
    "stage2": (2, 0.0, False),
    "stage3": (3, 0.0, False),
    "stage3_params": (3, 0.0, True),
    "stage2_clipped": (2, 1.0, False),  # the coefficient needs the norm: steps start at engine.step()
}


def _every_case() -> dict:
    return {
        name: {
            "on": _train(_config(stage, True, clip, params)),
            "off": _train(_config(stage, False, clip, params)),
        }
        for name, (stage, clip, params) in CASES.items()
    }


def _reference(world, clip):
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, weight_decay=0.0)
    sched = build_lr_scheduler(SCHED["type"], dict(SCHED["params"]), opt)
    losses = reference_train(
        model, opt, global_batches(world, STEPS), world_size=world, grad_accum=GAS, scheduler=sched, clip=clip
    )
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_every_case, 2, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_step_equals_sequential_step_and_pytorch(name, runs):
    stage, clip, _ = CASES[name]
    ref_losses, ref_state = _reference(2, clip)
    for rank, per_rank in enumerate(runs):
        on, off = per_rank[name]["on"], per_rank[name]["off"]
        assert on["stepper"] == "OverlappedStepper" and off["stepper"] == "InMemoryStepper"
        assert on["worked"] > 0
        assert on["losses"] == off["losses"]  # bitwise: the same kernels on the same tensors
        assert on["state"].keys() == off["state"].keys()
        for k in on["state"]:
            assert torch.equal(on["state"][k], off["state"][k]), k
        assert max(abs(a - b) for a, b in zip(on["losses"], ref_losses)) <= 1e-5
        if stage < 3 or rank == 0:  # stage 3's full state dict is gathered on rank 0
            for k, v in ref_state.items():
                torch.testing.assert_close(on["state"][k], v.float(), atol=1e-5, rtol=1e-4, msg=k)


def _early_start():
    """One boundary micro-step with a hook on the embedding weight: its gradient is the backward's last
    (the first layer runs last), so its hook marks the end of the backward."""
    model = build_model()
    cfg = _config(2, True)
    cfg["gradient_accumulation_steps"] = 1
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    stepper = engine.zero.stepper
    marks = []

    def last_gradient(_param):
        # give the worker a bounded chance to begin: if no step was submitted early this waits in vain
        # and the order below fails; with the early start the first step is already running or queued
        deadline = time.perf_counter() + 20
        while not any(e[0] == "start" for e in stepper.timeline) and time.perf_counter() < deadline:
            time.sleep(0.001)
        marks.append(time.perf_counter())

    engine.module.wte.weight.register_post_accumulate_grad_hook(last_gradient)
    rank, world = comm.get_rank(), comm.get_world_size()
    (batch,) = global_batches(world, 1)
    x, y = split_global_batch(batch, world, 1, rank)[0]
    engine.backward(engine(x, y))
    before_step = list(stepper.timeline)
    engine.step()
    out = {"timeline": before_step, "backward_end": marks[-1], "sub_groups": len(engine.zero.sub_groups)}
    # the early start commits the host step: a second boundary backward before engine.step() is refused
    engine.backward(engine(x, y))
    try:
        engine.backward(engine(x, y))
    except RuntimeError as err:
        out["refused"] = str(err)
    engine.destroy()
    return out


@pytest.mark.timeout(120)
def test_first_sub_group_steps_before_the_backward_ends():
    for r in run_distributed(_early_start, 2, timeout=90):
        assert r["sub_groups"] >= 3
        starts = [t for kind, j, t in r["timeline"] if kind == "start"]
        submits = [j for kind, j, _ in r["timeline"] if kind == "submit"]
        assert submits[0] == 0  # the sub-group whose gradients backward finishes first
        assert starts and starts[0] < r["backward_end"], r
        # every sub-group was submitted during the backward (before engine.step() was called)
        assert sorted(submits) == list(range(r["sub_groups"]))
        assert "overlap_step" in r["refused"] and "engine.step()" in r["refused"]
