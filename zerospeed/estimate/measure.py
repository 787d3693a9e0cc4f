"""`zerospeed-estimate --measure`: predicted vs measured per-rank model-state bytes on a real run.

N spawned gloo processes train a bias-free MLP for two optimizer steps at each ZeRO stage
(`harness.zero_probe`); the measurement is an independent census of live tensor storages
(not the engine's counters); the prediction is `stage_bytes` with zerospeed's fp32 gradient
accumulation. Offload rows are not measured here: on a CPU-only machine host and device are the same
memory, so a census cannot tell offloaded state apart (tests/dist/test_offload.py checks placement
and NVMe swap-file bytes instead).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerospeed.estimate.formulas import DTYPE_BYTES, Precision, stage_bytes

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


def _probe_stages(stages: tuple[int, ...], precision: str, width: int, layers: int) -> list[dict]:
    from harness.zero_probe import probe_model_states
    return [probe_model_states(s, precision, width=width, layers=layers) for s in stages]


def measure(world: int = 2, stages: tuple[int, ...] = (1, 2, 3), precision: str = "bf16", width: int = 512,
            layers: int = 4, timeout: float = 240.0) -> list[Measurement]:
    """Run the probe on `world` ranks; one Measurement per (stage, rank)."""
    unknown = [s for s in stages if s not in IMPLEMENTED_STAGES]
    if unknown:
        raise ValueError(f"--measure covers ZeRO stages {IMPLEMENTED_STAGES}, got stage {unknown[0]}")
    from harness import run_distributed
    per_rank = run_distributed(_probe_stages, world, tuple(stages), precision, width, layers, timeout=timeout)
    return [Measurement(rank, r["stage"], world, precision, r["params"],
                        predict(r["params"], world, r["stage"], precision), r["measured"])
            for rank, rows in enumerate(per_rank) for r in rows]


def format_measurements(rows: list[Measurement]) -> str:
    """A markdown table of predicted vs measured MB per rank."""
    lines = ["| ranks | rank | precision | stage | params | predicted MB/rank | measured MB/rank "
             "| measured/predicted |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {m.world} | {m.rank} | {m.precision} | {m.stage} | {m.params:,} | {m.predicted / 1e6:.2f} | "
              f"{m.measured / 1e6:.2f} | {m.ratio:.4f} |" for m in rows]
    return "\n".join(lines)
