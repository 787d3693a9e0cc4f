"""Pipeline bubble and activation memory: measured against the theory.

    .venv/bin/python benchmarks/bench_pipeline.py            # p = 2, 4; m = 4, 8 (~1 min on 2 cores)
    .venv/bin/python benchmarks/bench_pipeline.py --out benchmarks/pipeline_results.md

Each stage is one layer whose forward sleeps `t` and whose backward sleeps `2t` (plus a real
linear layer, so activations occupy memory). Sleeping keeps the stages' compute time exact on a
machine with fewer cores than processes. Per stage:

* bubble = idle / total, where total is the time from a barrier before the batch until the last
  stage finishes its last backward (the slowest rank), and idle = total - this stage's compute time.
  Theory for 1F1B and fill-drain with equal stages: (p - 1) / (m + p - 1).
* peak activation memory: the most bytes autograd held for backward at once on that stage
  (`engine.activation_stats`), 1F1B (at most p - stage micro-batches alive) vs fill-drain (all m).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.pipe import LayerSpec, PipelineModule

WIDTH, MICRO = 256, 16
TIMEOUT = 300


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)  # backward costs twice the forward, as in a real layer
        return grad, None


class SleepyLayer(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.linear(x)), self.seconds)


def _worker(micro_batches: int, seconds: float, schedule: str, repeats: int) -> dict:
    stages = comm.get_world_size()
    module = PipelineModule(
        [LayerSpec(SleepyLayer, seconds) for _ in range(stages)],
        num_stages=stages,
        loss_fn=lambda out, y: (out - y).pow(2).mean(),
        partition_method="uniform",
    )
    engine, *_ = zerospeed.initialize(
        model=module,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        },
    )
    engine.train_schedule = schedule
    data = [(torch.randn(MICRO, WIDTH), torch.randn(MICRO, WIDTH)) for _ in range(micro_batches)]
    bubbles = []
    for _ in range(repeats + 1):  # the first batch negotiates shapes: not measured
        comm.barrier()
        engine.train_batch(iter(data))
        # wall_s runs from the start of this stage's schedule; the slowest stage ends the pipeline
        total = max(comm.all_gather_object(engine.last_batch_timing["wall_s"]))
        bubbles.append((total - engine.last_batch_timing["compute_s"]) / total)
    return {
        "stage": engine.stage_id,
        "bubble": sum(bubbles[1:]) / repeats,
        "peak_bytes": engine.activation_stats["peak_bytes"],
        "peak_micro_batches": engine.activation_stats["peak_micro_batches"],
    }


def run(stages_list, micro_list, seconds: float, repeats: int) -> list[dict]:
    rows = []
    for p in stages_list:
        for m in micro_list:
            for schedule in ("1f1b", "fill_drain"):
                res = run_distributed(_worker, p, m, seconds, schedule, repeats, timeout=TIMEOUT)
                rows.append(
                    {
                        "p": p,
                        "m": m,
                        "schedule": schedule,
                        "theory": (p - 1) / (m + p - 1),
                        "bubble": [r["bubble"] for r in res],
                        "peak_mib": [r["peak_bytes"] / 2**20 for r in res],
                        "peak_micro_batches": [r["peak_micro_batches"] for r in res],
                    }
                )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| p | m | schedule | theory (p-1)/(m+p-1) | bubble per stage (measured) | peak activations per stage "
        "(MiB) | micro-batches alive per stage |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']} | {r['theory']:.3f} | "
            f"{' '.join(f'{b:.3f}' for b in r['bubble'])} | {' '.join(f'{b:.2f}' for b in r['peak_mib'])} | "
            f"{' '.join(str(n) for n in r['peak_micro_batches'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--micro-batches", default="4,8")
    parser.add_argument("--seconds", type=float, default=0.02, help="forward time per stage (backward: 2x)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="append the table (markdown) here; JSON beside it")
    args = parser.parse_args()
    rows = run(
        [int(s) for s in args.stages.split(",")],
        [int(m) for m in args.micro_batches.split(",")],
        args.seconds,
        args.repeats,
    )
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(
                f"\n## bench_pipeline.py (t = {args.seconds}s forward, {2 * args.seconds}s backward per stage)\n\n"
                f"{text}\n"
            )
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
