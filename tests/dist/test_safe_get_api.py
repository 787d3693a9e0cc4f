"""DeepSpeed's parameter accessors (`zerospeed.zero.tensor_access`) at ZeRO stages 0-3 on 2 ranks,
against the same model trained in one plain PyTorch process on the concatenated batch; and stage 0's
`param.grad` after backward (local before the accumulation boundary, averaged after it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.zero.tensor_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
)

WORLD, MICRO, GAS, STEPS = 2, 3, 2, 3
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def build_model():
    torch.manual_seed(0)
    # odd sizes: parameters straddle the ranks' chunks unevenly, and some rank holds none of a bias
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 3))
    model[4].bias.requires_grad_(False)  # frozen: no strategy owns it
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    n = WORLD * GAS * MICRO
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for _ in range(STEPS)]


def micro(batch, rank, m):
    """Rank `rank`'s micro-batch `m` of a global batch (the reference sees the whole batch at once)."""
    lo = (m * WORLD + rank) * MICRO
    return batch[0][lo : lo + MICRO], batch[1][lo : lo + MICRO]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def config(stage, **over):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0}},
        # small buckets: several flat layouts at stages 1-2
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0},
        **over,
    }


def gathered(t):
    """Every rank's local piece (None where a rank holds none), concatenated in rank order."""
    pieces = comm.all_gather_object(None if t is None else t.detach().cpu())
    return torch.cat([p for p in pieces if p is not None])


def close(a, b, what, atol=1e-6):
    torch.testing.assert_close(a.detach().cpu().float(), b.detach().float(), rtol=1e-5, atol=atol, msg=what)


def _check_locals(params, stage):
    for i, p in enumerate(params):
        for name, full, local in [
            ("param", safe_get_full_fp32_param(p), safe_get_local_fp32_param(p)),
            ("exp_avg", safe_get_full_optimizer_state(p, "exp_avg"), safe_get_local_optimizer_state(p, "exp_avg")),
        ]:
            if stage == 0:  # replicated: a rank's piece is the whole parameter
                close(local, full.reshape(-1), f"stage {stage} local {name} {i}")
            else:
                close(gathered(local), full.reshape(-1), f"stage {stage} gathered local {name} {i}")


def _check_before_boundary(stage, params, ref, batch, x, y, step):
    """Stages 0-1 hold this rank's own accumulated gradient (stage 0 shows it as `.grad`); stages 2-3
    the data-parallel average of the micro-steps so far."""
    plain = build_model_like(ref)
    if stage <= 1:
        (loss_fn(plain(x), y) / GAS).backward()
    else:
        first = slice(0, WORLD * MICRO)  # every rank's first micro-batch
        (loss_fn(plain(batch[0][first]), batch[1][first]) / GAS).backward()
    for i, (p, q) in enumerate(zip(params, [q for q in plain.parameters() if q.requires_grad])):
        close(safe_get_full_grad(p), q.grad, f"stage {stage} grad before the boundary {i} step {step}")
        if stage == 0:
            close(p.grad, q.grad, f"stage 0 p.grad before the boundary {i} step {step}")


def _run_stage(stage, persistent=False):
    rank = comm.get_rank()
    model = build_model()
    ref = build_model()
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.Adam(ref_params, lr=LR, betas=BETAS, eps=EPS)
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = model[4].bias
    cfg = config(stage)
    if persistent:  # stage 3 with every unit always gathered: setters refresh the resident copies too
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**6
    engine, *_ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    engine.zero.bind_optimizer(engine.optimizer)  # the engine's own line once core.py binds it
    for step, batch in enumerate(batches()):
        ref_opt.zero_grad()
        loss_fn(ref(batch[0]), batch[1]).backward()
        for m in range(GAS):
            x, y = micro(batch, rank, m)
            engine.backward(loss_fn(engine(x), y))
            if m == 0:  # before the boundary
                _check_before_boundary(stage, params, ref, batch, x, y, step)
            if m < GAS - 1:
                engine.step()  # not a boundary: counts the micro-step (DeepSpeed's loop calls it every time)
        # at the boundary, before step: the gradient of the whole batch (averaged over the ranks)
        for i, (p, q) in enumerate(zip(params, ref_params)):
            close(safe_get_full_grad(p), q.grad, f"stage {stage} full grad {i} step {step}")
            if stage == 0:
                assert p.grad is not None and p.grad.data_ptr() == safe_get_full_grad(p).data_ptr()
                close(p.grad, q.grad, f"stage 0 p.grad {i}")
            else:
                close(gathered(safe_get_local_grad(p)), q.grad.reshape(-1), f"stage {stage} local grad {i}")
        assert safe_get_full_grad(frozen) is None and safe_get_full_fp32_param(frozen) is None
        engine.step()
        ref_opt.step()
        assert all(safe_get_full_grad(p) is None for p in params)  # gradients are gone after the step
        if stage == 0:
            assert all(p.grad is None for p in params)
        for i, (p, q) in enumerate(zip(params, ref_params)):
            close(safe_get_full_fp32_param(p), q, f"stage {stage} fp32 param {i} step {step}")
            for key in ("exp_avg", "exp_avg_sq"):
                close(
                    safe_get_full_optimizer_state(p, key),
                    ref_opt.state[q][key],
                    f"stage {stage} {key} {i}",
                    atol=1e-8 if key == "exp_avg_sq" else 1e-6,
                )
        if step == 0:
            _check_locals(params, stage)
            # setters: a new weight and momentum on both sides; the next steps must agree again
            with torch.no_grad():
                new = ref_params[0] * 0.5 + 0.01
                ref_params[0].copy_(new)
                safe_set_full_fp32_param(params[0], new)
                ref_opt.state[ref_params[2]]["exp_avg"].mul_(-1.0)
                safe_set_full_optimizer_state(params[2], ref_opt.state[ref_params[2]]["exp_avg"], "exp_avg")
                local = safe_get_local_fp32_param(params[1])  # local setter: double this rank's piece
                safe_set_local_fp32_param(params[1], None if local is None else local * 2)
                ref_params[1].mul_(2.0)
            close(safe_get_full_fp32_param(params[0]), new, f"stage {stage} set full param")
            close(safe_get_full_fp32_param(params[1]), ref_params[1], f"stage {stage} set local param")
    engine.zero.remove_hooks()
    return True


def build_model_like(ref):
    """A plain copy of the reference's current weights (for a rank-local gradient)."""
    model = build_model()
    model.load_state_dict(ref.state_dict())
    return model


def _mixed_precision():
    """bf16 at stage 0 keeps fp32 accumulation: no `.grad` view (its dtype differs), the accessor
    answers in fp32; fp16 at stage 1 answers the loss-scaled gradient, as DeepSpeed does."""
    rank = comm.get_rank()
    out = {}
    for name, stage, extra in [
        ("bf16", 0, {"bf16": {"enabled": True}}),
        ("fp16", 1, {"fp16": {"enabled": True, "initial_scale_power": 4}}),
    ]:
        model = build_model()
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = zerospeed.initialize(model=model, model_parameters=params, config=config(stage, **extra))
        batch = batches()[0]
        for m in range(GAS):
            x, y = micro(batch, rank, m)
            engine.backward(loss_fn(engine(x.to(engine.module[0].weight.dtype)), y))
            if m < GAS - 1:
                engine.step()
        grads = [safe_get_full_grad(p) for p in params]
        assert all(g.dtype == torch.float32 for g in grads)
        out[name] = {
            "grads": [g.cpu() / engine.loss_scale for g in grads],
            "param_grad_none": all(p.grad is None for p in params),
            "scale": engine.loss_scale,
        }
        engine.zero.remove_hooks()
    return out


def _all_stages():
    for stage in (0, 1, 2, 3):
        _run_stage(stage)
    _run_stage(3, persistent=True)
    return _mixed_precision()


@pytest.mark.timeout(120)
def test_accessors_match_plain_pytorch_at_every_stage():
    results = run_distributed(_all_stages, WORLD, timeout=110)
    ref = build_model()
    loss_fn(ref(batches()[0][0]), batches()[0][1]).backward()
    want = [p.grad for p in ref.parameters() if p.requires_grad]
    for r in results:
        assert r["bf16"]["param_grad_none"] and r["fp16"]["param_grad_none"]
        assert r["fp16"]["scale"] == 16.0
        for name, atol in (("bf16", 2e-2), ("fp16", 2e-3)):
            for g, w in zip(r[name]["grads"], want):
                torch.testing.assert_close(g, w, rtol=5e-2, atol=atol, msg=name)
