"""`zerospeed-estimate --measure`: predicted vs measured per-rank model-state bytes on a real run.

N spawned gloo processes (`estimate.ranks`) train a bias-free MLP for two optimizer steps at each ZeRO
stage; the measurement is an independent census of live tensor storages (`estimate.live_tensors`, not
the engine's counters); the prediction is `stage_bytes` with zerospeed's fp32 gradient accumulation.
Offload rows are not measured here: on a CPU-only machine host and device are the same memory, so a
census cannot tell offloaded state apart (tests/dist/test_offload.py checks placement and NVMe
swap-file bytes instead).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from zerospeed.estimate.formulas import DTYPE_BYTES, Precision, stage_bytes
from zerospeed.estimate.live_tensors import live_tensor_bytes
from zerospeed.estimate.ranks import run_on_ranks
from zerospeed.runtime.initialize import initialize
from zerospeed.zero import full_numel

IMPLEMENTED_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Measurement:
    rank: int
    stage: int
    world: int
    precision: str
    params: int
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def predict(params: int, world: int, stage: int, precision: str) -> float:
    """Per-rank model-state bytes the engine should hold (AdamW, fp32 gradient accumulation)."""
    prec = Precision(DTYPE_BYTES[precision], 4, 0 if precision == "fp32" else 4, 8)
    return sum(stage_bytes(params, world, stage, prec).values())


class _CastLinear(torch.nn.Linear):
    """A linear layer that casts its input to its weight's dtype. The cast is read inside the layer's own
    forward: a read of a layer's weight from its parent's forward would, at ZeRO stage 3, gather that
    layer early and hold it to the end of the micro-step (Note [undeclared external parameters],
    zero/stage3/external.py), changing the traffic and memory this model is used to measure."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


class BiasFreeMLP(torch.nn.Module):
    """``layers`` square linear layers without bias: exactly layers * width^2 parameters, all trained."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CastLinear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().pow(2).mean()


def _probe(stage: int, precision: str, width: int, layers: int, grad_accum: int = 2) -> dict:
    """On one rank of a job: the live tensor bytes one engine adds after two optimizer steps."""
    gc.collect()
    baseline = live_tensor_bytes()
    torch.manual_seed(0)
    zero = {"stage": stage, "overlap_comm": True}
    if stage == 3:  # every unit freed after each use, so no gathered weights outlive the step
        zero["stage3_max_reuse_distance"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = initialize(model=BiasFreeMLP(width, layers), config=cfg)
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(engine.global_rank))
    for _ in range(2 * grad_accum):
        engine.backward(engine(x))
        engine.step()
    del x
    measured = live_tensor_bytes() - baseline
    params = sum(full_numel(p) for p in engine.module.parameters())
    engine.zero.remove_hooks()  # the next stage's engine must not find this one's hooks on the autograd graph
    return {"stage": stage, "params": params, "measured": measured}


def _probe_stages(stages: tuple[int, ...], precision: str, width: int, layers: int) -> list[dict]:
    return [_probe(s, precision, width, layers) for s in stages]


def measure(
    world: int = 2,
    stages: tuple[int, ...] = (1, 2, 3),
    precision: str = "bf16",
    width: int = 512,
    layers: int = 4,
    timeout: float = 240.0,
) -> list[Measurement]:
    """Run the probe on `world` ranks; one Measurement per (stage, rank)."""
    unknown = [s for s in stages if s not in IMPLEMENTED_STAGES]
    if unknown:
        raise ValueError(f"--measure covers ZeRO stages {IMPLEMENTED_STAGES}, got stage {unknown[0]}")
    per_rank = run_on_ranks(_probe_stages, world, tuple(stages), precision, width, layers, timeout=timeout)
    return [
        Measurement(
            rank,
            r["stage"],
            world,
            precision,
            r["params"],
            predict(r["params"], world, r["stage"], precision),
            r["measured"],
        )
        for rank, rows in enumerate(per_rank)
        for r in rows
    ]


def format_measurements(rows: list[Measurement]) -> str:
    """A markdown table of predicted vs measured MB per rank."""
    lines = [
        "| ranks | rank | precision | stage | params | predicted MB/rank | measured MB/rank | measured/predicted |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {m.world} | {m.rank} | {m.precision} | {m.stage} | {m.params:,} | {m.predicted / 1e6:.2f} | "
        f"{m.measured / 1e6:.2f} | {m.ratio:.4f} |"
        for m in rows
    ]
    return "\n".join(lines)
