"""ZeRO-Offload's one-step delayed parameter update (`offload_optimizer.delayed_param_update`).

The reference is a plain single-process PyTorch loop of the rule in Note [delayed parameter update]
(zerospeed/offload/delayed_update.py), written here on whole tensors: AdamW steps fp32 master copies;
for the first `warm_up` steps the result reaches the model at once; after that each step first copies
the masters (the previous step's result) into the model and then steps them, so the next step's
forward and backward run on weights one update old. 2 ranks, ZeRO 1-2, fp32, two param groups, an LR
schedule, gradient accumulation, clipping: every loss, the final weights and the final masters (read
through `safe_get_full_fp32_param` while the last host step may still run) within 1e-5, and away from
plain AdamW (the delay is real). Without the key the engine is today's (same stepper, plain
AdamW's numbers), and with a warm-up longer than the run it is bitwise today's.

Resuming (Note [delayed update in checkpoints]): a checkpoint saved with a host step in flight (sync at
ZeRO 1-2, async at ZeRO 2) leaves the saving run bitwise equal to a run without the save (itself the
reference's within 1e-5), and a fresh engine with other initial weights that loads it continues
bitwise equal to it: the same tensors through the same steps, so no tolerance is needed. One rank
loading it (resharded) continues within 1e-5 (another summation order); an engine without the delay
follows the reference that publishes the pending update at the load.
"""

from __future__ import annotations

import pytest
import torch
from test_zero_parity import GAS, SCHED, build_model, global_batches, param_groups, zero_config

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from harness.reference import engine_global_step
from zerospeed import comm
from zerospeed.config import ConfigError, parse_config
from zerospeed.optim import build_lr_scheduler
from zerospeed.runtime.plans import offload_plan
from zerospeed.zero.tensor_access import safe_get_full_fp32_param

STEPS = 6
KEY = "zero_optimization.offload_optimizer.delayed_param_update"


def _config(stage, clip=1.0, **offload):
    cfg = zero_config(stage, gradient_clipping=clip)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", **offload}
    return cfg


def _train(config):
    model = build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = [engine_global_step(engine, batch, world, GAS, rank) for batch in global_batches(world, STEPS)]
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    # DeepSpeed's accessor waits for the host step in flight and reads its result (one update ahead)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    kind = type(engine.zero.stepper).__name__
    engine.destroy()
    return {"losses": losses, "state": state, "masters": masters, "stepper": kind}


CASES = {  # name -> (stage, gradient_clipping, offload_optimizer keys)
    "stage2": (2, 1.0, {"delayed_param_update": True}),
    "stage2_warm_up": (2, 0.0, {"delayed_param_update": True, "delayed_param_update_warm_up": 2}),
    "stage1": (1, 1.0, {"delayed_param_update": True}),
    "off": (2, 1.0, {}),  # the key absent: today's engine
    "off_explicit": (2, 1.0, {"delayed_param_update": False}),
    "warm_up_whole_run": (2, 1.0, {"delayed_param_update": True, "delayed_param_update_warm_up": STEPS}),
}


def _every_case() -> dict:
    return {name: _train(_config(stage, clip, **keys)) for name, (stage, clip, keys) in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_every_case, 2, timeout=150)


def reference_delayed(world, clip, warm_up, until=None):
    """Plain PyTorch, one process: the delayed rule over the same global batches (None: plain AdamW).
    `until`: from that step on without the delay, the pending update published before its forward (a
    checkpoint saved after `until` steps, loaded with the delay off). Returns the losses, the final
    weights and (the delayed rule) the final masters by name."""
    model = build_model()
    groups = param_groups(model)
    if warm_up is None:
        opt = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.0)
        sched = build_lr_scheduler(SCHED["type"], dict(SCHED["params"]), opt)
        losses = reference_train(
            model, opt, global_batches(world, STEPS), world_size=world, grad_accum=GAS, scheduler=sched, clip=clip
        )
        return losses, model.state_dict(), None
    params = [p for g in groups for p in g["params"]]
    masters = [p.detach().clone() for p in params]
    it = iter(masters)
    opt = torch.optim.AdamW(
        [{**g, "params": [next(it) for _ in g["params"]]} for g in groups], lr=3e-3, weight_decay=0.0
    )
    sched = build_lr_scheduler(SCHED["type"], dict(SCHED["params"]), opt)
    losses = []
    for t, batch in enumerate(global_batches(world, STEPS)):
        if t == until:  # the load publishes the update the checkpoint holds unpublished
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for rank in range(world):
            for x, y in split_global_batch(batch, world, GAS, rank):
                loss = model(x, y)
                (loss / (world * GAS)).backward()
                total += loss.item()
        losses.append(total / (world * GAS))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        delayed = t >= warm_up and (until is None or t < until)
        with torch.no_grad():
            if delayed:  # publish the previous step's result, then step: it reaches the model next time
                for p, m in zip(params, masters):
                    p.copy_(m)
            for p, m in zip(params, masters):
                m.grad = p.grad.clone()
            opt.step()
            sched.step()
            if not delayed:
                for p, m in zip(params, masters):
                    p.copy_(m)
    names = {id(p): n for n, p in model.named_parameters()}
    return losses, model.state_dict(), {names[id(p)]: m for p, m in zip(params, masters)}


def _close(run, ref_losses, ref_state):
    assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses)) <= 1e-5, (run["losses"], ref_losses)
    for k, v in ref_state.items():
        torch.testing.assert_close(run["state"][k], v.float(), atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["stage2", "stage2_warm_up", "stage1"])
def test_delayed_update_equals_pytorch_reference(name, runs):
    _, clip, keys = CASES[name]
    ref_losses, ref_state, ref_masters = reference_delayed(2, clip, keys.get("delayed_param_update_warm_up", 0))
    plain_losses, _, _ = reference_delayed(2, clip, None)
    for per_rank in runs:
        run = per_rank[name]
        assert run["stepper"] == "DelayedStepper"
        _close(run, ref_losses, ref_state)
        for k, v in ref_masters.items():  # the last step's result, not yet in the weights
            torch.testing.assert_close(run["masters"][k], v, atol=1e-5, rtol=1e-4, msg=k)
            assert not torch.allclose(run["masters"][k], run["state"][k], atol=1e-6), k
        # the delay changes the numbers: away from plain AdamW by far more than the tolerance
        assert max(abs(a - b) for a, b in zip(run["losses"], plain_losses)) > 1e-3


@pytest.mark.timeout(200)
def test_off_by_default_is_todays_engine(runs):
    ref_losses, ref_state, _ = reference_delayed(2, 1.0, None)
    for per_rank in runs:
        off, explicit, warm = per_rank["off"], per_rank["off_explicit"], per_rank["warm_up_whole_run"]
        assert off["stepper"] == explicit["stepper"] == "OverlappedStepper"  # today's default stepper
        _close(off, ref_losses, ref_state)
        for k, v in off["masters"].items():  # nothing in flight: the masters are the weights
            torch.testing.assert_close(v, off["state"][k])
        # bitwise: the same steps on the same tensors (a warm-up as long as the run never delays)
        for other in (explicit, warm):
            assert other["losses"] == off["losses"]
            for k in off["state"]:
                assert torch.equal(other["state"][k], off["state"][k]), k


@pytest.mark.parametrize(
    "zero,match",
    [
        ({"stage": 3}, "stages 1 and 2"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, 'device to "cpu"'),
        ({"stage": 2, "zenflow": {"topk_ratio": 0.1}}, "ZenFlow"),
    ],
)
def test_refusals_name_the_key(zero, match):
    offload = {"device": "cpu", **zero.pop("offload_optimizer", {}), "delayed_param_update": True}
    cfg = parse_config({"train_batch_size": 2, "zero_optimization": {**zero, "offload_optimizer": offload}})
    with pytest.raises(ConfigError, match=match) as err:
        offload_plan(cfg, torch.device("cpu"))
    assert KEY in str(err.value)


# -- resuming from a checkpoint (Note [delayed update in checkpoints]) ---------------------------------
WARM_UP, CUT = 1, 3  # saved after 3 steps: steps 1-2 were delayed, step 2's host step is in flight at the save


def _engine(config, seed=None):
    model = build_model()
    if seed is not None:  # other initial weights: the load must bring every one of them back
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _steps(engine, batches) -> list[float]:
    rank, world = comm.get_rank(), comm.get_world_size()
    return [engine_global_step(engine, batch, world, GAS, rank) for batch in batches]


def _finish(engine, losses) -> dict:
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.destroy()
    return {"losses": losses, "state": state, "masters": masters}


def _resumes(stage, root, modes) -> dict:
    """The uninterrupted run; per mode ("sync", "async") a run that saves after CUT steps and goes on, and
    a fresh engine (other weights) that loads that checkpoint and continues; ("off") the sync checkpoint
    loaded by an engine without the delay."""
    delayed = _config(stage, 1.0, delayed_param_update=True, delayed_param_update_warm_up=WARM_UP)
    data = global_batches(comm.get_world_size(), STEPS)
    whole = _engine(delayed)
    out = {"whole": _finish(whole, _steps(whole, data))}
    for mode in modes:
        if mode == "off":
            loader = _engine(_config(stage, 1.0), seed=1)
            loader.load_checkpoint(root, tag="sync")
            out["off"] = _finish(loader, _steps(loader, data[CUT:]))
            continue
        cfg = {**delayed, "checkpoint": {"writer": {"decoupled": True}}} if mode == "async" else delayed
        saver = _engine(cfg)
        losses = _steps(saver, data[:CUT])
        saver.save_checkpoint(root, tag=mode)  # async: committed at a later step, the host step runs meanwhile
        out["saver_" + mode] = _finish(saver, losses + _steps(saver, data[CUT:]))
        loader = _engine(cfg, seed=1)
        loader.load_checkpoint(root, tag=mode)
        out["resumed_" + mode] = _finish(loader, _steps(loader, data[CUT:]))
    return out


def _resume_alone(root) -> dict:
    """One rank loads the 2-rank sync checkpoint (resharded) and continues over the same global batches
    (twice the accumulation steps)."""
    cfg = _config(2, 1.0, delayed_param_update=True, delayed_param_update_warm_up=WARM_UP)
    cfg["gradient_accumulation_steps"] = 2 * GAS
    engine = _engine(cfg, seed=1)
    engine.load_checkpoint(root, tag="sync")
    losses = [engine_global_step(engine, batch, 1, 2 * GAS, 0) for batch in global_batches(2, STEPS)[CUT:]]
    return _finish(engine, losses)


RESUMES = {1: ["sync"], 2: ["sync", "async", "off"]}


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    out = {}
    for stage, modes in RESUMES.items():
        root = str(tmp_path_factory.mktemp(f"z{stage}"))
        out[stage] = run_distributed(_resumes, 2, stage, root, modes, timeout=150)
    out["alone"] = run_distributed(_resume_alone, 1, root, timeout=100)[0]
    return out


def _bitwise(run, whole, first=0):
    assert run["losses"] == whole["losses"][first:], (run["losses"], whole["losses"][first:])
    for part in ("state", "masters"):
        for k, v in whole[part].items():
            assert torch.equal(run[part][k], v), (part, k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,mode", [(1, "sync"), (2, "sync"), (2, "async")])
def test_resume_equals_the_uninterrupted_run(stage, mode, resumes):
    ref_losses, ref_state, _ = reference_delayed(2, 1.0, WARM_UP)
    for per_rank in resumes[stage]:
        whole = per_rank["whole"]
        _close(whole, ref_losses, ref_state)  # the uninterrupted run is the delayed rule
        _bitwise(per_rank["saver_" + mode], whole)  # saving changes nothing in the run that saves
        _bitwise(per_rank["resumed_" + mode], whole, first=CUT)  # the resumed run is the same run


@pytest.mark.timeout(300)
def test_resume_without_the_delay_publishes_the_pending_update(resumes):
    ref_losses, ref_state, _ = reference_delayed(2, 1.0, WARM_UP, until=CUT)
    for per_rank in resumes[2]:
        off, whole = per_rank["off"], per_rank["whole"]
        _close(off, ref_losses[CUT:], ref_state)
        assert max(abs(a - b) for a, b in zip(off["losses"], whole["losses"][CUT:])) > 1e-4


@pytest.mark.timeout(300)
def test_resume_at_another_world_size(resumes):
    """The pending update survives a resharded load: one rank continues as the two ranks did."""
    whole, alone = resumes[2][0]["whole"], resumes["alone"]
    assert max(abs(a - b) for a, b in zip(alone["losses"], whole["losses"][CUT:])) <= 1e-5
    for part in ("state", "masters"):
        for k, v in whole[part].items():
            torch.testing.assert_close(alone[part][k], v, atol=1e-5, rtol=1e-4, msg=k)
