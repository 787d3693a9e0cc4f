"""The overlapped CPU optimizer of plain offload (Note [overlapped step] in optim/sub_group_step.py).

`offload_optimizer.overlap_step` (zerospeed's own key, default true) steps each sub-group on a host
worker thread — during the boundary backward when the step's coefficient is known in advance (no
clipping, no loss scale), else from `engine.step()` on, pipelined with the copy back. Each case trains
the same 2-rank fp32 job with the overlap on and off: the losses and final weights must be bitwise
equal, and both must match a plain single-process PyTorch run with torch.optim.AdamW (<= 1e-5). The
early-start test shows the worker's first sub-group step begins before the backward's last gradient is
accumulated (timestamps of the stepper and of a gradient hook, not a sleep). At stage 3 with parameter
offload `engine.step()` returns before the last host steps (Note [deferred tail] in
optim/sub_group_step.py): the last test shows the next forward's first unit gathered and run while the
last sub-group is still stepping, and after its own sub-group's step.
"""

from __future__ import annotations

import time
import warnings

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
    losses, deferred = [], []
    for batch in global_batches(world, STEPS):
        losses.append(engine_global_step(engine, batch, world, GAS, rank))
        # Note [deferred tail]: host steps of this engine.step() still unfinished (the next forward finishes them)
        deferred.append(bool(getattr(engine.zero.stepper, "in_flight", False)))
    kind = type(engine.zero.stepper).__name__
    worked = len(getattr(engine.zero.stepper, "timeline", ()))  # the last step's events on the worker
    if engine.zero_optimization_stage() == 3:
        state = {k: v.float() for k, v in engine.zero.full_state_dict().items()}  # rank 0 only
    else:
        state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"losses": losses, "state": state, "stepper": kind, "worked": worked, "deferred": deferred}


CASES = {  # name -> (stage, gradient_clipping, parameter offload)
    "stage1": (1, 0.0, False),
    "stage2": (2, 0.0, False),
    "stage3": (3, 0.0, False),
    "stage3_params": (3, 0.0, True),  # early start and the deferred tail
    "stage3_params_clipped": (3, 1.0, True),  # steps start at engine.step(), in sub-group order; deferred tail
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
        # the last host steps outlive engine.step() exactly where the shards live in host memory (stage 3,
        # offload_param); the final weights above were consolidated while they were still in flight
        assert on["deferred"] == [CASES[name][2]] * STEPS and off["deferred"] == [False] * STEPS
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
    # torch's own scheduler: it must see the optimizer as stepped even though only snapshots of it stepped
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.5**s)
    base_lr = engine.optimizer.param_groups[0]["lr"]

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    out = {"timeline": before_step, "backward_end": marks[-1], "sub_groups": len(engine.zero.sub_groups)}
    out["scheduler_warnings"] = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    out["lr"] = (base_lr, engine.optimizer.param_groups[0]["lr"])
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
        assert r["scheduler_warnings"] == []  # (torch warns when it thinks the optimizer never stepped)
        base, lr = r["lr"]
        assert lr == base * 0.5  # LambdaLR's formula after one step
        starts = [t for kind, j, t in r["timeline"] if kind == "start"]
        submits = [j for kind, j, _ in r["timeline"] if kind == "submit"]
        assert submits[0] == 0  # the sub-group whose gradients backward finishes first
        assert starts and starts[0] < r["backward_end"], r
        # every sub-group was submitted during the backward (before engine.step() was called)
        assert sorted(submits) == list(range(r["sub_groups"]))
        assert "overlap_step" in r["refused"] and "engine.step()" in r["refused"]


def _tail_overlaps_next_forward():
    """Stage 3, parameter offload, clipping (the host steps start at engine.step(), in sub-group order).
    Step 1's first sub-group holds its step until a reader waits for it (the stepper's "finish" event: step
    2's first gather), its last one until step 2's first module has run its forward. Each wait is bounded:
    where step() waits for every host step, or a gather for none or for all of them, the order below fails."""
    model = build_model()
    cfg = _config(3, True, clip=1.0, params=True)
    cfg["gradient_accumulation_steps"] = 1
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    zero = engine.zero
    zero.stepper.copies_back = True  # as _train: on this CPU-only machine the worker is not used otherwise
    sub_of = {k: j for j, sub in enumerate(zero.sub_groups) for k in sub}
    first = {sub_of[fp.index] for fp in zero.uses[id(engine.module.wte)] if fp.master is not None}
    events, armed = [], [False]

    def waits_for(what, trace):
        deadline = time.perf_counter() + 20
        while not any(e[:2] == what for e in trace) and time.perf_counter() < deadline:
            time.sleep(0.001)

    def sub_group(optimizer):
        (j,) = {sub_of[k] for k, m in enumerate(zero.masters) if m.grad is not None}
        return j

    def before_step(optimizer, args, kwargs):  # (on the host step's worker thread)
        j = sub_group(optimizer)
        if armed[0] and j == 0:
            waits_for(("finish", 0), zero.stepper.timeline)
        if armed[0] and j == len(zero.sub_groups) - 1:
            waits_for(("forward", -1), events)
        events.append(("start", j, time.perf_counter()))

    def after_step(optimizer, args, kwargs):
        events.append(("end", sub_group(optimizer), time.perf_counter()))

    def first_forward(module, args):  # runs after zerospeed's pre-hook has gathered the module
        if armed[0] and not any(e[0] == "forward" for e in events):
            events.append(("forward", -1, time.perf_counter()))

    engine.optimizer.register_step_pre_hook(before_step)
    engine.optimizer.register_step_post_hook(after_step)
    engine.module.wte.register_forward_pre_hook(first_forward)
    rank, world = comm.get_rank(), comm.get_world_size()
    batches = [split_global_batch(b, world, 1, rank)[0] for b in global_batches(world, 3)]
    for step, (x, y) in enumerate(batches):
        loss = engine(x, y)
        armed[0] = False  # step 2's first forward is over
        if step == 2:
            waited = [t for kind, j, t in zero.stepper.timeline if kind == "finish" and j == 0]
        engine.backward(loss)  # (it waits for every host step of the previous engine.step())
        if step == 2:
            seen = list(events)  # step 1's host steps, step 2's forward
        if step == 1:
            events.clear()
            armed[0] = True
        engine.step()
        if step == 1:
            events.append(("returned", -1, time.perf_counter()))
    engine.destroy()
    return {"events": seen, "waited": waited, "sub_groups": len(zero.sub_groups), "first": sorted(first)}


@pytest.mark.timeout(120)
def test_next_forward_gathers_while_the_last_host_steps_run():
    for r in run_distributed(_tail_overlaps_next_forward, 2, timeout=90):
        n, events = r["sub_groups"], r["events"]
        assert n >= 3 and r["first"] == [0], r
        starts = [j for kind, j, _ in events if kind == "start"]
        end = {j: t for kind, j, t in events if kind == "end"}
        (returned,) = [t for kind, _, t in events if kind == "returned"]
        (forward,) = [t for kind, _, t in events if kind == "forward"]
        assert starts == list(range(n)) and sorted(end) == starts, events  # one step each, in sub-group order
        (waited,) = r["waited"]  # the first gather of step 2 waited for sub-group 0 (and only the fetch did)
        assert returned < waited < end[0]  # engine.step() returned before its first host step ended
        assert end[0] < forward  # the first module's gather waited for its own sub-group's step ...
        assert forward < end[n - 1]  # ... and ran while the last sub-group was still stepping


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) checkpoint object, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _bf16_readers(overlap: bool, save_dir: str):
    """bf16 weights (the publication is a real fp32 -> bf16 copy into the shards) at stage 3 with parameter
    offload, the layer norms persistent (gathered again by their next fetch after a deferred step); right
    after engine.step(), with its host steps possibly in flight: a checkpoint save after step 2,
    DeepSpeed's accessors after the last step, then the consolidated weights."""
    from zerospeed.zero.tensor_access import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = build_model()
    cfg = _config(3, overlap, params=True) | {"bf16": {"enabled": True}}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    if hasattr(engine.zero.stepper, "copies_back"):
        engine.zero.stepper.copies_back = True
    rank, world = comm.get_rank(), comm.get_world_size()
    losses, deferred = [], []
    for step, batch in enumerate(global_batches(world, STEPS)):
        losses.append(engine_global_step(engine, batch, world, GAS, rank))
        deferred.append(bool(getattr(engine.zero.stepper, "in_flight", False)))
        if step == 1:
            engine.save_checkpoint(save_dir, tag="mid")
    persistent = sum(fp.persistent for fp in engine.zero.flat)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    last = named[-1][1]  # (in the last sub-group: the first to read after the step)
    read = {"fp32": safe_get_full_fp32_param(last).clone(), "v": safe_get_full_optimizer_state(last, "exp_avg_sq")}
    read["v"] = read["v"].clone()
    state = {k: v.float() for k, v in engine.zero.full_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "deferred": deferred, "read": read, "state": state, "persistent": persistent}


@pytest.mark.timeout(120)
def test_bf16_readers_right_after_a_deferred_step_equal_the_sequential_step(tmp_path):
    on = run_distributed(_bf16_readers, 2, True, str(tmp_path / "on"), timeout=90)
    off = run_distributed(_bf16_readers, 2, False, str(tmp_path / "off"), timeout=90)
    for a, b in zip(on, off):
        assert a["deferred"] == [True] * STEPS and b["deferred"] == [False] * STEPS
        assert a["persistent"] >= 3
        assert a["losses"] == b["losses"]
        for k in ("fp32", "v"):
            assert torch.equal(a["read"][k], b["read"][k]), k
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k
    files = sorted(p.relative_to(tmp_path / "on") for p in (tmp_path / "on").rglob("*.pt"))
    assert files and files == sorted(p.relative_to(tmp_path / "off") for p in (tmp_path / "off").rglob("*.pt"))
    for f in files:
        ta = _tensors(torch.load(tmp_path / "on" / f, weights_only=False))
        tb = _tensors(torch.load(tmp_path / "off" / f, weights_only=False))
        assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb)), f
