"""`zerospeed-plot RUN_DIR`: turn a CSV monitor's files into PNG line plots.

Every `<tag>.csv` under RUN_DIR (header `step,<tag>`, as `csv_monitor` writes) becomes
`<tag>.png` next to it (or under --out): loss, learning rate, throughput. Per-rank series
(`<tag>_rank<r>.csv`, e.g. memory) share one plot, `<tag>.png`, with a line per rank and a legend.
The x axis is the monitors' step: samples seen, as DeepSpeed logs them.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

from zerospeed.monitor.plot import save_line_plot

PER_RANK = re.compile(r"^(?P<base>.+)_rank(?P<rank>\d+)$")


def read_series(path: Path) -> tuple[str, list[float], list[float]]:
    """(tag, steps, values) of one monitor CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or len(rows[0]) != 2 or rows[0][0] != "step":
        raise ValueError(f"{path}: not a csv_monitor file (expected a 'step,<tag>' header)")
    try:
        data = [(float(s), float(v)) for s, v in rows[1:]]
    except ValueError as exc:
        raise ValueError(f"{path}: bad row ({exc})") from None
    return rows[0][1], [s for s, _ in data], [v for _, v in data]


def _group(run_dir: Path) -> dict[tuple[Path, str, bool], dict[int | None, tuple[str, list[float], list[float]]]]:
    """{(directory, png stem, per rank?): {rank or None: (tag, steps, values)}} of the CSVs with data."""
    groups: dict = {}
    for path in sorted(run_dir.rglob("*.csv")):
        tag, xs, ys = read_series(path)
        if ys:
            m = PER_RANK.match(path.stem)
            key = (path.parent, m["base"], True) if m else (path.parent, path.stem, False)
            groups.setdefault(key, {})[int(m["rank"]) if m else None] = (tag, xs, ys)
    return groups


def _axis_name(tag: str) -> str:
    return tag.rsplit("/", 1)[-1].replace("_", " ")  # Train/Samples/train_loss -> train loss


def _plot(png: Path, series: dict[int | None, tuple[str, list[float], list[float]]], per_rank: bool) -> None:
    if not per_rank:
        tag, xs, ys = series[None]
        save_line_plot(png, ys, xs=xs, title=tag, xlabel="samples", ylabel=_axis_name(tag))
        return
    tag = PER_RANK.sub(r"\g<base>", series[min(series)][0])
    ranks = sorted(series)
    save_line_plot(
        png,
        {f"rank {r}": series[r][2] for r in ranks},
        xs={f"rank {r}": series[r][1] for r in ranks},
        title=f"{tag} per rank",
        xlabel="samples",
        ylabel=_axis_name(tag),
    )


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per monitor tag under `run_dir` (per-rank tags share one); returns the PNG paths."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a directory")
    written = []
    for (parent, stem, per_rank), series in _group(run_dir).items():
        png = (Path(out_dir) if out_dir else parent) / (stem + ".png")
        _plot(png, series, per_rank)
        written.append(png)
    if not written:
        raise ValueError(f"no csv_monitor files with data under {run_dir} (enable csv_monitor in the config)")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerospeed-plot", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the csv_monitor output directory (output_path/job_name) or a parent of it")
    p.add_argument("--out", help="write the PNGs here instead of next to each CSV")
    args = p.parse_args(argv)
    try:
        for png in plot_run(args.run_dir, args.out):
            print(png)
    except ValueError as exc:
        print(f"zerospeed-plot: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
