"""`zerospeed-plot RUN_DIR`: turn a CSV monitor's files into PNG line plots.

Every `<tag>.csv` under RUN_DIR (header `step,<tag>`, as `csv_monitor` writes) becomes
`<tag>.png` next to it (or under --out): loss, learning rate, throughput, memory per rank.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from zerospeed.utils.plot import save_line_plot


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


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per monitor CSV under `run_dir`; returns the PNG paths."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a directory")
    written = []
    for path in sorted(run_dir.rglob("*.csv")):
        tag, xs, ys = read_series(path)
        if not ys:
            continue
        png = (Path(out_dir) if out_dir else path.parent) / (path.stem + ".png")
        save_line_plot(png, ys, xs=xs, title=f"{tag} vs samples")
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
