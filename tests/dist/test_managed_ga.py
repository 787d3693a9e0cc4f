"""`managed_gradient_accumulation: false` and `engine.coalesce_grad_reduction()` (ZeRO 1-3) on 2 gloo ranks, against a
plain single-process PyTorch loop that replays the caller's step schedule by hand (fp32, max |dw| <= 1e-5).

The reference follows DeepSpeed 0.19.8's rules (Note [caller-managed accumulation] in
runtime/grad_accumulation.py): every backward divides its loss by `gradient_accumulation_steps`, whatever
the number of backwards the caller puts in a window; the gradient is averaged over the ranks; each
`step()` applies one update.
"""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import run_distributed
from zerospeed import comm

WORLD, MICRO, GAS, LR = 2, 3, 2, 0.1
WINDOWS = [2, 1, 3, 2]  # backwards per caller-decided step (unmanaged)
COALESCED = 4  # backwards per coalesce_grad_reduction block


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batches(n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """n micro-steps; each a list over ranks of (x, y)."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(WORLD)]
        for _ in range(n)
    ]


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _config(stage: int, managed: bool, gas: int = GAS) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,  # (DeepSpeed's default clips at 1.0; the reference does not clip)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 16},
    }


def _weights(engine) -> dict[str, torch.Tensor]:
    if engine.zero.weights_in_shards:
        return {k: v.float().clone() for k, v in engine.zero.full_state_dict().items()}
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _reference(windows: list[int], divide_by: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: each window is one SGD step over the sum of its micro-batches' losses / divide_by,
    averaged over the ranks."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches, at = _batches(sum(windows)), 0
    for k in windows:
        opt.zero_grad()
        for step in batches[at : at + k]:
            for x, y in step:
                (_loss(model, x, y) / divide_by / WORLD).backward()
        at += k
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unmanaged(stage: int):
    rank = comm.get_rank()
    engine, *_ = zerospeed.initialize(model=_model(), config=_config(stage, managed=False))
    batches, at, losses, seen = _batches(sum(WINDOWS)), 0, [], {}
    for k in WINDOWS:
        for step in batches[at : at + k]:
            loss = _loss(engine, *step[rank])
            engine.backward(loss)
            losses.append(loss.item())
            seen.setdefault("boundary_outside_step", set()).add(engine.is_gradient_accumulation_boundary())
        if stage == 0:  # stage 0 shows the local, not yet reduced, gradient as .grad
            seen.setdefault("local_grads", []).append(next(engine.module.parameters()).grad.clone())
        at += k
        engine.step()
        seen.setdefault("applied", []).append(engine.was_step_applied())
    try:
        engine.set_gradient_accumulation_boundary(True)
    except AssertionError as e:
        seen["set_boundary_error"] = str(e)
    try:
        with engine.coalesce_grad_reduction():
            pass
    except AssertionError as e:
        seen["coalesce_error"] = str(e)
    seen.update(
        weights=_weights(engine),
        losses=losses,
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        micro_steps=engine.micro_steps,
    )
    return seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_caller_managed_steps_match_plain_pytorch(stage):
    ranks = run_distributed(_unmanaged, WORLD, stage, timeout=200)
    ref = _reference(WINDOWS, divide_by=GAS)
    for r in ranks[:1] if stage == 3 else ranks:  # (stage 3 gathers the full weights on rank 0)
        for name, value in ref.items():
            assert (r["weights"][name] - value).abs().max().item() <= 1e-5, (stage, name)
    for r in ranks:
        assert r["boundary_outside_step"] == {False}
        assert r["applied"] == [True] * len(WINDOWS)
        assert r["global_steps"] == len(WINDOWS) and r["micro_steps"] == len(WINDOWS)
        # DeepSpeed: (train_batch_size / gradient_accumulation_steps) per backward since the last step
        assert r["global_samples"] == MICRO * WORLD * sum(WINDOWS)
        assert "managed_gradient_accumulation=false" in r["set_boundary_error"]
        assert "managed_gradient_accumulation=false" in r["coalesce_error"]
    if stage == 0:  # backward kept each rank's own gradient: the reduction waited for step()
        assert all(not torch.equal(a, b) for a, b in zip(ranks[0]["local_grads"], ranks[1]["local_grads"]))
    # each rank's losses are its own micro-batches' under the reference's weights
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches, at, i = _batches(sum(WINDOWS)), 0, 0
    for k in WINDOWS:
        opt.zero_grad()
        for step in batches[at : at + k]:
            for rank, (x, y) in enumerate(step):
                loss = _loss(model, x, y)
                assert abs(loss.item() - ranks[rank]["losses"][i]) <= 1e-5
                (loss / GAS / WORLD).backward()
            i += 1
        at += k
        opt.step()


def _reductions() -> int:
    """Gradient reductions issued so far (comm.STATS: reduce-scatters and all-reduces; stage 3's weight
    all-gathers are not reductions)."""
    kinds = comm.STATS.snapshot()
    return sum(kinds.get(k, {}).get("calls", 0) for k in ("reduce_scatter", "all_reduce"))


def _coalesce(stage: int):
    rank = comm.get_rank()
    config = _config(stage, managed=True, gas=1)
    if stage == 3:  # every unit gathered around its uses and released after them (none kept resident)
        config["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0
        )
    engine, *_ = zerospeed.initialize(model=_model(), config=config)
    batches = _batches(2 * COALESCED + 1)
    counts, step_error, released = [], None, []
    if stage == 3:  # when the first layer's backward starts, the last one's weights are back to their shards
        last = engine.zero.flat[1]
        engine.module[0].register_full_backward_pre_hook(lambda *_: released.append(last.state.name))
    for s in range(2):
        comm.STATS.reset()
        with engine.coalesce_grad_reduction():
            for i, step in enumerate(batches[s * COALESCED : (s + 1) * COALESCED]):
                engine.set_gradient_accumulation_boundary(i == COALESCED - 1)
                engine.backward(_loss(engine, *step[rank]))
            counts.append(_reductions())
            if s == 1:
                try:
                    engine.step()
                except AssertionError as e:
                    step_error = str(e)
        counts.append(_reductions())
        engine.step()
    weights = _weights(engine)
    comm.STATS.reset()  # one ordinary backward: the reductions of one pass
    engine.set_gradient_accumulation_boundary(None)
    engine.backward(_loss(engine, *batches[-1][rank]))
    counts.append(_reductions())
    return {
        "weights": weights,
        "counts": counts,
        "step_error": step_error,
        "steps": engine.global_steps,
        "released": released,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_coalesced_reduction_matches_plain_pytorch(stage):
    ranks = run_distributed(_coalesce, WORLD, stage, timeout=200)
    ref = _reference([COALESCED, COALESCED], divide_by=1)  # gradient_accumulation_steps=1
    for r in ranks[:1] if stage == 3 else ranks:  # (stage 3 gathers the full weights on rank 0)
        for name, value in ref.items():
            assert (r["weights"][name] - value).abs().max().item() <= 1e-5, (stage, name)
    for r in ranks:
        inside_1, after_1, inside_2, after_2, one_backward = r["counts"]
        assert inside_1 == 0 and inside_2 == 0  # no reduction while the block runs
        assert one_backward > 0 and after_1 == after_2 == one_backward  # one reduction pass per block
        assert "inside coalesce_grad_reduction" in r["step_error"]
        assert r["steps"] == 2
        if stage == 3:  # inside the blocks (held gradients) as after them (reduced at once)
            assert r["released"] == ["SHARDED"] * (2 * COALESCED + 1)


def _coalesce_refusal():
    engine, *_ = zerospeed.initialize(model=_model(), config=_config(0, managed=True, gas=1))
    try:
        with engine.coalesce_grad_reduction():
            pass
    except NotImplementedError as e:
        return str(e)


@pytest.mark.timeout(120)
def test_coalesce_refuses_stage_0():
    r = run_distributed(_coalesce_refusal, WORLD, timeout=100)[0]
    assert r == "coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0"  # DeepSpeed's message
