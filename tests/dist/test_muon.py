"""Muon at ZeRO 0-3 on 2 ranks (optim/muon.py, Note [Muon on ZeRO shards]).

- parity: 10 steps equal a plain single-process reference written here from Muon's formulas (Newton-Schulz
  in float64 by the plain quintic iteration, torch's AdamW for the Adam half), with a reduce bucket small
  enough that every Muon matrix straddles the two ranks' chunks, at ZeRO 0-3 and with CPU optimizer
  offload at ZeRO 2 and 3;
- DeepSpeed: the same script as tests/fixtures/deepspeed_0.19.8/make_muon.py gives the losses and weights
  the real DeepSpeed 0.19.8 recorded there;
- the bytes the Muon all-gathers move per step, against the formula of the note;
- a resumed run equals an uninterrupted one bitwise.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import zerospeed
from harness import run_distributed
from zerospeed import comm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8"
sys.path.insert(0, str(FIXTURES))
from make_muon import batches, config, model  # noqa: E402

WORLD, GAS, MICRO = 2, 2, 2
SMALL_BUCKET = 50  # every Muon matrix (96, 72, 18 elements) gets a layout of its own, cut between the ranks


def _config(stage, ns_method="gram", bucket=None, offload=False):
    cfg = config(stage, ns_method)
    if offload:  # masters, momentum and gradient chunks in host memory (Note [Muon on ZeRO shards])
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if bucket is not None:
        cfg["zero_optimization"]["reduce_bucket_size"] = bucket
        if stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def _full_weights(engine) -> dict[str, torch.Tensor]:
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train(engine, steps) -> list[float]:
    rank = comm.get_rank()
    losses = []
    for x, y in steps:
        total = 0.0
        for micro in range(GAS):
            lo = (micro * WORLD + rank) * MICRO
            loss = ((engine(x[lo : lo + MICRO]) - y[lo : lo + MICRO]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    return losses


def _engine(cfg):
    m = model()
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return engine


def train_runs(runs):
    """On every rank: each (stage, ns_method, bucket, offload) run for STEPS steps -> (losses, weights)."""
    out = []
    for run in runs:
        engine = _engine(_config(*run))
        out.append((_train(engine, batches()), _full_weights(engine)))
    return out


# -- the reference: Muon's formulas in one process ------------------------------------------------------
def _newton_schulz(u: torch.Tensor) -> torch.Tensor:
    """Five quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315) on the wide orientation, float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def _clip_coefficient(tensors, max_norm=1.0):
    """DeepSpeed's `gradient_clipping` (default 1.0): max_norm / (global L2 norm + 1e-6), at most 1."""
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()
    return min(1.0, max_norm / (norm + 1e-6))


def reference_run(params, clip_the_update):
    """Mean loss per step and final weights of DeepSpeed's Muon arithmetic, single process, fp32.

    DeepSpeed's default gradient clipping (1.0) acts on the raw gradients at ZeRO 0, where Muon runs inside
    the optimizer's step, and on Muon's update at ZeRO 1-3, where the ZeRO optimizer orthogonalises the
    gradients before it takes the norm (`clip_the_update`)."""
    m = model()
    muon = [p for n, p in m.named_parameters() if p.ndim >= 2 and "embed" not in n]
    adam = [p for n, p in m.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    adamw = torch.optim.AdamW(
        adam, lr=params["adam_lr"], betas=tuple(params["betas"]), eps=params["eps"], weight_decay=params["weight_decay"]
    )
    beta, lr, wd = params["momentum"], params["muon_lr"], params["weight_decay"]
    momentum = {p: torch.zeros_like(p) for p in muon}
    losses = []
    for x, y in batches():
        m.zero_grad()
        total = 0.0
        for micro in range(GAS):
            for rank in range(WORLD):
                lo = (micro * WORLD + rank) * MICRO
                loss = ((m(x[lo : lo + MICRO]) - y[lo : lo + MICRO]) ** 2).mean()
                (loss / (GAS * WORLD)).backward()
                total += loss.item()
        with torch.no_grad():
            if not clip_the_update:
                coef = _clip_coefficient([p.grad for p in m.parameters()])
                for p in m.parameters():
                    p.grad.mul_(coef)
            updates = {}
            for p in muon:
                momentum[p] = beta * momentum[p] + (1 - beta) * p.grad
                blend = beta * momentum[p] + (1 - beta) * p.grad  # Nesterov
                rows, cols = p.shape
                updates[p] = (_newton_schulz(blend) * math.sqrt(max(1.0, rows / cols))).float()
            if clip_the_update:
                coef = _clip_coefficient([*updates.values(), *(p.grad for p in adam)])
                for t in [*updates.values(), *(p.grad for p in adam)]:
                    t.mul_(coef)
            for p in muon:
                p.mul_(1 - lr * wd).sub_(lr * updates[p])
        adamw.step()
        losses.append(total / (GAS * WORLD))
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.timeout(400)
def test_muon_zero_stages_match_reference_and_deepspeed():
    recorded = json.loads((FIXTURES / "muon" / "losses.json").read_text())
    parity = [(0, "gram", SMALL_BUCKET), (1, "gram", SMALL_BUCKET), (2, "gram", SMALL_BUCKET, True)]
    parity += [(2, "gram", SMALL_BUCKET), (3, "gram", SMALL_BUCKET), (3, "gram", SMALL_BUCKET, True)]
    ds_runs = {f"zero{s}": (s, "gram", None) for s in range(4)} | {"zero2_standard": (2, "standard", None)}
    results = run_distributed(train_runs, WORLD, parity + list(ds_runs.values()), timeout=360)[0]
    params = config(0, "gram")["optimizer"]["params"]
    refs = [reference_run(params, clip_the_update=False), reference_run(params, clip_the_update=True)]
    for (stage, *_), (losses, weights) in zip(parity, results):
        ref_losses, ref_weights = refs[stage > 0]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (stage, losses, ref_losses)
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], atol=1e-5, rtol=0, msg=f"stage {stage}: {name}")
    for (name, run), (losses, weights) in zip(ds_runs.items(), results[len(parity) :]):
        theirs = recorded["runs"][name]
        # DeepSpeed compiles its Newton-Schulz with torch.compile: fp32 ("gram" on this CPU) agrees to
        # rounding; bf16 ("standard") fuses its intermediates in fp32 where eager rounds each op to bf16.
        tol = 1e-5 if theirs["ns_compute_dtype"][run[1]] == "torch.float32" else 5e-3
        assert max(abs(a - b) for a, b in zip(losses, theirs["losses"])) <= tol, (name, losses, theirs["losses"])
        for n, w in weights.items():
            torch.testing.assert_close(w, torch.tensor(theirs["weights"][n]), atol=tol, rtol=0, msg=f"{name}: {n}")


def muon_gather_bytes():
    """On every rank, ZeRO 2 with the small bucket: all-gather payload bytes of one boundary step."""
    engine = _engine(_config(2, "gram", SMALL_BUCKET))
    (x, y), rank = batches()[0], comm.get_rank()
    for micro in range(GAS):
        lo = (micro * WORLD + rank) * MICRO
        engine.backward(((engine(x[lo : lo + MICRO]) - y[lo : lo + MICRO]) ** 2).mean())
        if micro == GAS - 1:
            comm.STATS.reset()
        engine.step()
    return comm.STATS.snapshot().get("all_gather", {})


@pytest.mark.timeout(200)
def test_muon_gather_bytes_match_the_formula():
    # Layouts of <= 50 elements, each padded to a multiple of world * 4 (Note [flat-layout partition]):
    # Muon half fc1.weight 96 | fc2.weight 72 | out.weight 18 -> 24; Adam half embed 32+8 | 12+6+6+6 -> 32.
    muon_padded, adam_padded = 96 + 72 + 24, 40 + 32
    stats = run_distributed(muon_gather_bytes, WORLD, timeout=160)[0]
    # one all-gather of each Muon layout's fp32 blend, then every layout's updated parameters (fp32)
    assert stats["payload_bytes"] == (muon_padded + muon_padded + adam_padded) * 4
    assert stats["calls"] == 3 + 5
    assert stats["wire_bytes"] == pytest.approx(stats["payload_bytes"] * (WORLD - 1) / WORLD)


def resume_equals_uninterrupted(stage, folder):
    """On every rank: 3 steps, save, a fresh engine loads and trains 3 more == 6 steps in one go."""
    cfg = _config(stage, "gram", SMALL_BUCKET)
    steps = batches()[:6]
    straight = _engine(cfg)
    losses = _train(straight, steps)
    first = _engine(cfg)
    _train(first, steps[:3])
    first.save_checkpoint(folder, tag="t3")
    resumed = _engine(cfg)
    resumed.load_checkpoint(folder, tag="t3")
    later = _train(resumed, steps[3:])
    a, b = _full_weights(straight), _full_weights(resumed)
    return losses[3:] == later and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_muon_resume_is_bitwise(stage, tmp_path):
    assert all(run_distributed(resume_equals_uninterrupted, WORLD, stage, str(tmp_path), timeout=260))
