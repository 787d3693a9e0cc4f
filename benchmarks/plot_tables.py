"""Bar charts of the step-time tables recorded in docs/benchmarks.md (no re-run needed).

    python benchmarks/plot_tables.py docs/benchmarks.md docs/img

Every `bench_step` table (a markdown table whose first two columns are `variant` and `median step
(ms)`) becomes `docs/img/bench_<date>_<time>.png`, named after the `#### bench_step — <date> <time>`
heading above it. Prints the files written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from zerospeed.monitor.plot import save_bar_chart

HEADING = re.compile(r"^#+ bench_step — (\d{4}-\d\d-\d\d) (\d\d):(\d\d) UTC")


def tables(text: str) -> list[tuple[str, list[str], list[float]]]:
    """(stamp, variants, median step ms) of every bench_step table in `text`, in order."""
    out, stamp, rows, in_table = [], None, [], False
    for line in text.splitlines() + [""]:
        m = HEADING.match(line)
        if m:
            stamp = f"{m.group(1)}_{m.group(2)}{m.group(3)}"
            continue
        if line.startswith("| variant | median step (ms)"):
            in_table, rows = True, []
            continue
        if in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not cells[0].startswith("---"):
                rows.append((cells[0], float(cells[1].replace(",", ""))))
            continue
        if in_table:
            in_table = False
            if stamp and rows:
                out.append((stamp, [r[0] for r in rows], [r[1] for r in rows]))
    return out


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/plot_tables.py docs/benchmarks.md OUT_DIR")
    src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    for stamp, names, ms in tables(src.read_text()):
        path = out_dir / f"bench_{stamp}.png"
        save_bar_chart(
            path,
            names,
            ms,
            title=f"median step time, bench_step {stamp.replace('_', ' ')} UTC",
            unit=" ms",
            xlabel="median step time (ms)",
            width=720,
        )
        print(path)


if __name__ == "__main__":
    main()
