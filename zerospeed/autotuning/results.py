"""The autotuner's records and its output files (pure formatting; `write_*` only write files).

Every candidate of the space gets one `Record`: tried (ok / crashed / timed out / no metric), cut by
the planner (pruned: does not fit; dominated: a faster tier fits the same micro batch) or not run
(the search ended first). ``results.csv`` and ``results.md`` list them all; ``summary.txt`` is
DeepSpeed's per-space summary (best per ZeRO stage and overall).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerospeed.autotuning.space import Candidate
from zerospeed.autotuning.tuner import better

NOT_RUN = "not run"
METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}
UNITS = {"throughput": "samples/s", "latency": "ms/step", "flops": "FLOPS/GPU"}
COLUMNS = (
    "exp",
    "stage",
    "micro_batch",
    "gas",
    "train_batch_size",
    "offload_optimizer",
    "offload_param",
    "estimate_mib",
    "status",
    "throughput",
    "latency_ms",
    "flops_per_gpu",
    "seconds",
    "note",
)


@dataclass
class Record:
    """One candidate and what became of it."""

    candidate: Candidate
    status: str
    estimate_bytes: float = 0.0
    metrics: dict[str, Any] | None = None
    seconds: float | None = None
    note: str = ""
    order: int | None = None  # position among the trials run

    def value(self, metric: str) -> float | None:
        if self.status != "ok" or not self.metrics:
            return None
        return self.metrics.get(METRIC_KEYS[metric])


def best_record(records: list[Record], metric: str) -> Record | None:
    """The record with the best metric value (the earliest tried among equals)."""
    best = None
    for r in sorted((r for r in records if r.value(metric) is not None), key=lambda r: r.order or 0):
        if best is None or better(r.value(metric), best.value(metric), metric):
            best = r
    return best


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def table_rows(records: list[Record], dp_size: int) -> list[dict[str, str]]:
    """One dict per record, COLUMNS as keys, tried ones first in trial order."""
    rows = []
    for r in sorted(records, key=lambda r: (r.order is None, r.order or 0)):
        c, m = r.candidate, r.metrics or {}
        rows.append(
            {
                "exp": c.name,
                "stage": str(c.stage),
                "micro_batch": str(c.micro_batch),
                "gas": str(c.gas),
                "train_batch_size": str(c.micro_batch * c.gas * dp_size),
                "offload_optimizer": c.offload_optimizer,
                "offload_param": c.offload_param,
                "estimate_mib": f"{r.estimate_bytes / 2**20:.1f}" if r.estimate_bytes else "",
                "status": r.status,
                "throughput": _fmt(m.get("throughput")),
                "latency_ms": _fmt(m.get("latency")),
                "flops_per_gpu": _fmt(m.get("FLOPS_per_gpu")),
                "seconds": _fmt(r.seconds, 3),
                "note": r.note,
            }
        )
    return rows


def to_csv(rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_markdown(rows: list[dict[str, str]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row[c].replace("|", "/") for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def space_name(c: Candidate) -> str:
    """DeepSpeed's tuning-space names: z0 .. z3 (plus the offload devices)."""
    parts = [f"z{c.stage}"]
    if c.offload_optimizer != "none":
        parts.append(f"offopt-{c.offload_optimizer}")
    if c.offload_param != "none":
        parts.append(f"offparam-{c.offload_param}")
    return "_".join(parts)


def summary(records: list[Record], metric: str, seconds: float) -> str:
    """DeepSpeed's summary.txt: per tuning space the experiments run and the best, then the global best."""
    tried = [r for r in records if r.order is not None]
    spaces: dict[str, list[Record]] = {}
    for r in sorted(tried, key=lambda r: r.order):
        spaces.setdefault(space_name(r.candidate), []).append(r)
    head = ("tuning_space", "num_experiments", f"best_metric_val ({UNITS[metric]})", "best_exp_name")
    rows = []
    for name, rs in sorted(spaces.items()):
        b = best_record(rs, metric)
        rows.append(
            {
                head[0]: name,
                head[1]: str(len(rs)),
                head[2]: _fmt(b.value(metric)) if b else "",
                head[3]: b.candidate.name if b else "(none succeeded)",
            }
        )
    b = best_record(tried, metric)
    rows.append(
        {
            head[0]: "global",
            head[1]: str(len(tried)),
            head[2]: _fmt(b.value(metric)) if b else "",
            head[3]: b.candidate.name if b else "(none succeeded)",
        }
    )
    took = datetime.timedelta(seconds=round(seconds))
    return to_markdown(rows, head) + f"\n\nTuning completed in {took}. Total number of experiments: {len(tried)}.\n"


def write_results(results_dir: Path, records: list[Record], metric: str, seconds: float, dp_size: int) -> str:
    """results.csv, results.md, summary.txt; returns the summary."""
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = table_rows(records, dp_size)
    text = summary(records, metric, seconds)
    (results_dir / "results.csv").write_text(to_csv(rows))
    (results_dir / "results.md").write_text(
        f"# Autotuning results (metric: {metric}, {UNITS[metric]})\n\n" + to_markdown(rows) + "\n\n" + text
    )
    (results_dir / "summary.txt").write_text(text)
    return text


def write_optimal(results_dir: Path, config: dict[str, Any], command: list[str]) -> Path:
    """ds_config_optimal.json (without the autotuning block, as DeepSpeed) and cmd_optimal.txt."""
    path = results_dir / "ds_config_optimal.json"
    clean = {k: v for k, v in config.items() if k != "autotuning"}
    path.write_text(json.dumps(clean, indent=2) + "\n")
    (results_dir / "cmd_optimal.txt").write_text(" ".join(command) + "\n")
    return path
