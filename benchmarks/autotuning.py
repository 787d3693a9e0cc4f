"""Autotuning on the demo model: the tuned pick vs the best of an exhaustive grid, and the time each took.

    .venv/bin/python benchmarks/autotuning.py                # ZeRO 0-3 x micro batch 1, 2, 4, 8: 16 configs
    .venv/bin/python benchmarks/autotuning.py --micro-batches 2,8 --stages 0,3 --quick   # a smoke run

Both runs use the same space and the same short profiled trials of examples/train_gpt.py (2 ranks,
the small GPT, steps 3-8 timed) through `zerospeed.autotuning.Autotuner`:

- grid: every configuration as a trial (`exhaustive=True`: no model-information run, no pruning,
  no early stopping);
- tuned: what ``zerospeed --autotuning tune`` does with ``tuner_type: model_based`` (the
  model-information run, the estimator's cut, the model-based search), its wall time including
  everything.

The acceptance of issue 21: the tuned pick is within 10% of the grid's best (its throughput as the
grid measured it, so both numbers come from the same run), in at most 30% of the grid's wall time.
On a shared machine the load moves during the minutes a grid takes, so the script ends with a
confirmation round: the grid's best and the tuned pick measured alternately (``--confirm-rounds``
each), back to back; ``--confirm A,B`` runs only that round for two experiment names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerospeed.autotuning.autotuner import Autotuner  # noqa: E402
from zerospeed.autotuning.results import best_record, table_rows, to_markdown  # noqa: E402
from zerospeed.autotuning.space import Candidate  # noqa: E402
from zerospeed.launcher.environment import UserCommand  # noqa: E402

SHOWN = ("exp", "status", "throughput", "latency_ms", "estimate_mib", "seconds", "note")


def bench_config(stages: list[int], micro_batches: list[int], out: Path, start: int, end: int) -> dict:
    """The demo's ZeRO-2 config (examples/configs/gpt_zero2.json) with the tuning lists in place."""
    cfg = json.loads((ROOT / "examples/configs/gpt_zero2.json").read_text())
    cfg.pop("csv_monitor", None)
    cfg["train_micro_batch_size_per_gpu"] = micro_batches
    cfg["zero_optimization"]["stage"] = stages
    cfg["autotuning"] = {
        "enabled": True,
        "tuner_type": "model_based",
        "metric": "throughput",
        "start_profile_step": start,
        "end_profile_step": end,
        "results_dir": str(out / "results"),
        "exps_dir": str(out / "exps"),
    }
    return cfg


def run(name: str, cfg: dict, out: Path, args, exhaustive: bool):
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "ds_config.json").write_text(json.dumps(cfg, indent=1))
    script_args = (
        "--deepspeed",
        str(out / "ds_config.json"),
        "--model-size",
        args.model_size,
        "--corpus-bytes",
        str(args.corpus_bytes),
        "--out-dir",
        str(out / "demo"),
    )
    command = UserCommand(str(ROOT / "examples/train_gpt.py"), script_args)
    start = time.monotonic()
    outcome = Autotuner(["--num_gpus", str(args.nproc)], command, exhaustive=exhaustive, cwd=ROOT).tune()
    wall = time.monotonic() - start
    print(
        f"\n## {name}: {len([r for r in outcome.records if r.order is not None])} trials, {wall:.1f} s"
        + (f" (model-information run {outcome.profile_seconds:.1f} s)" if outcome.profile_seconds else "")
    )
    rows = table_rows(outcome.records, args.nproc)
    print(to_markdown(rows, SHOWN))
    return outcome, wall


def confirm(names: list[str], cfg: dict, out: Path, args) -> dict[str, list[float]]:
    """Measure the named configurations alternately, ``args.confirm_rounds`` times each."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "ds_config.json").write_text(json.dumps(cfg, indent=1))
    script_args = (
        "--deepspeed",
        str(out / "ds_config.json"),
        "--model-size",
        args.model_size,
        "--corpus-bytes",
        str(args.corpus_bytes),
        "--out-dir",
        str(out / "demo"),
    )
    tuner = Autotuner(
        ["--num_gpus", str(args.nproc)],
        UserCommand(str(ROOT / "examples/train_gpt.py"), script_args),
        exhaustive=True,
        cwd=ROOT,
    )
    cands = {n: next(c for c in _space(tuner) if c.name == n) for n in names}
    values: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.confirm_rounds):
        for n, c in cands.items():
            values[n].append(tuner.measure(c).value("throughput") or 0.0)
    print("\n## confirmation, alternately back to back\n\n| config | throughput (samples/s) | mean |\n|---|---|---|")
    for n, v in values.items():
        print(f"| {n} | {', '.join(f'{x:.1f}' for x in v)} | {sum(v) / len(v):.1f} |")
    return values


def _space(tuner: Autotuner) -> list[Candidate]:
    from zerospeed.autotuning.planner import plan

    return [p.candidate for p in plan(tuner.space, None, None, prune_dominated=False)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model-size", default="small")
    p.add_argument("--corpus-bytes", type=int, default=300_000, help="the demo's corpus (less start-up per trial)")
    p.add_argument("--start-step", type=int, default=3)
    p.add_argument("--end-step", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="profile steps 2-3 only (a smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "autotuning_bench")
    p.add_argument("--confirm-rounds", type=int, default=2)
    p.add_argument("--confirm", default=None, help="only the confirmation round, for two experiment names")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[autotuning] %(message)s")
    if args.quick:
        args.start_step, args.end_step = 2, 3
    stages = [int(s) for s in args.stages.split(",")]
    micro = [int(m) for m in args.micro_batches.split(",")]
    load = os.getloadavg()
    if args.confirm:
        confirm(
            args.confirm.split(","),
            bench_config(stages, micro, args.out / "confirm", args.start_step, args.end_step),
            args.out / "confirm",
            args,
        )
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return 0
    print(
        f"# autotuning benchmark: {args.model_size} GPT, {args.nproc} ranks, stages {stages} x micro batches "
        f"{micro}, steps {args.start_step}-{args.end_step} timed; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} on {os.cpu_count()} CPUs"
    )
    grid, grid_wall = run(
        "grid (every configuration)",
        bench_config(stages, micro, args.out / "grid", args.start_step, args.end_step),
        args.out / "grid",
        args,
        exhaustive=True,
    )
    tuned, tuned_wall = run(
        "tuned (model_based)",
        bench_config(stages, micro, args.out / "tuned", args.start_step, args.end_step),
        args.out / "tuned",
        args,
        exhaustive=False,
    )
    best = best_record(grid.records, "throughput")
    if best is None or tuned.best is None:
        print("no successful trial in one of the runs")
        return 1
    pick = next(r for r in grid.records if r.candidate == tuned.best.candidate)
    quality = (pick.value("throughput") or 0) / best.value("throughput")
    own = tuned.best.value("throughput") / best.value("throughput")
    ratio = tuned_wall / grid_wall
    load = os.getloadavg()
    print(
        f"\n## result\n\n| | config | throughput (samples/s) |\n|---|---|---|\n"
        f"| grid best | {best.candidate.name} | {best.value('throughput'):.1f} |\n"
        f"| tuned pick (grid's measurement) | {pick.candidate.name} | {pick.value('throughput') or 0:.1f} |\n"
        f"| tuned pick (its own trial) | {tuned.best.candidate.name} | {tuned.best.value('throughput'):.1f} |\n\n"
        f"pick / grid best = {quality:.3f} (own trial: {own:.3f}; acceptance >= 0.90)\n"
        f"wall time: tuned {tuned_wall:.1f} s / grid {grid_wall:.1f} s = {ratio:.3f} (acceptance <= 0.30)\n"
        f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    names = [best.candidate.name] + ([pick.candidate.name] if pick.candidate != best.candidate else [])
    if args.confirm_rounds and len(names) == 2:
        v = confirm(
            names,
            bench_config(stages, micro, args.out / "confirm", args.start_step, args.end_step),
            args.out / "confirm",
            args,
        )
        quality = (sum(v[names[1]]) / len(v[names[1]])) / (sum(v[names[0]]) / len(v[names[0]]))
        print(f"\nconfirmed: pick / grid best = {quality:.3f} (means of the confirmation round)")
    return 0 if quality >= 0.9 and ratio <= 0.3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
