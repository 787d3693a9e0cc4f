"""Measure what ZeRO really holds and sends, independently of the engine's own bookkeeping.

`probe_model_states` runs on every rank of a job: it builds a >= 5M-parameter model, trains one step
and reports the live tensor bytes the run added (the census in `harness.census`), next to
the formula's prediction and the comm gateway's per-step bytes. Used by the memory tests and by
`benchmarks/zero_memory.py`.
"""

from __future__ import annotations

import gc

import torch

import zerospeed
from harness.census import live_tensor_bytes
from zerospeed import comm
from zerospeed.estimate.measure import BiasFreeMLP  # layers * width^2 parameters (5 x 1024^2 = 5.24M)
from zerospeed.zero import full_numel as zero_full_numel


def probe_model_states(
    stage: int, precision: str = "bf16", width: int = 1024, layers: int = 5, grad_accum: int = 2
) -> dict:
    """One rank's view: census bytes added by the engine after one step, prediction, comm bytes."""
    gc.collect()
    baseline = live_tensor_bytes()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "overlap_comm": True},
    }  # (stage 3: every layer > persistence)
    if stage == 3:  # free every unit after each use: forward and backward each gather it (3x traffic)
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=BiasFreeMLP(width, layers), config=cfg)
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(comm.get_rank()))
    for micro in range(2 * grad_accum):  # two optimizer steps; count the second one's traffic
        if micro == grad_accum:
            comm.STATS.reset()
        engine.backward(engine(x))
        engine.step()
    traffic = comm.STATS.snapshot()
    del x
    gc.collect()
    measured = live_tensor_bytes() - baseline
    breakdown = engine.memory_breakdown()
    padded = _padded_numel(engine)
    engine.zero.remove_hooks()
    return {
        "stage": stage,
        "precision": precision,
        "world": comm.get_world_size(),
        "params": sum(zero_full_numel(p) for p in engine.module.parameters()),
        "padded_params": padded,
        "measured": measured,
        "predicted": sum(breakdown["predicted"].values()),
        "engine_counted": sum(breakdown["measured"].values()),
        "traffic": traffic,
    }


def _padded_numel(engine) -> int:
    flat = getattr(engine.zero, "flat", None)
    if flat is None:
        return sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    if engine.zero.weights_in_shards:
        return sum(fp.padded for fp in flat)
    return sum(layout.padded for fg in flat for layout in fg.layouts)


def probe_all(stages=(0, 1, 2, 3), precisions=("fp32", "bf16")) -> list[dict]:
    return [probe_model_states(s, p) for p in precisions for s in stages]
