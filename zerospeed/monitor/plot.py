"""PNG line plots and bar charts drawn with matplotlib (the `plots` extra: `pip install 'zerospeed[plots]'`).

Used by the demo's loss curve (`examples/train_gpt.py`), `zerospeed-plot` (the csv_monitor series)
and the benchmark charts. Each chart is built on its own `matplotlib.figure.Figure` (rendered by
Agg), never through `pyplot`, so no global figure state leaks between calls or threads, and it is
written to a temporary file and renamed: a reader never sees half an image.

`line_figure` / `bar_figure` return the Figure (for tests or further styling); `save_line_plot` /
`save_bar_chart` build and write it in one call. matplotlib is imported on first use, so
`import zerospeed` does not pay for it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from zerospeed.utils.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["bar_figure", "line_figure", "save_bar_chart", "save_figure", "save_line_plot"]

Series = Sequence[float]
DPI = 100
MIN_WIDTH, MIN_HEIGHT = 160, 120  # below this, labelled axes do not fit
FONT = {"title": 12, "label": 11, "ticks": 9}
BAR_ROW_PX = 34  # height of one bar's row in a bar chart


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "zerospeed's plots need matplotlib: pip install 'zerospeed[plots]' (or pip install matplotlib)"
        ) from None
    return Figure


def _new_figure(width: int, height: int) -> Figure:
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        raise ValueError(
            f"a {width}x{height} image is too small for labelled axes; use at least {MIN_WIDTH}x{MIN_HEIGHT} pixels"
        )
    return _matplotlib_figure()(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")


def _label_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    if title:
        ax.set_title(title, fontsize=FONT["title"])
    ax.set_xlabel(xlabel, fontsize=FONT["label"])
    ax.set_ylabel(ylabel, fontsize=FONT["label"])
    ax.tick_params(labelsize=FONT["ticks"])


def _finite_or_nan(xs: Series, ys: Series) -> tuple[list[float], list[float]]:
    """Points with a non-finite coordinate become nan on both axes: matplotlib breaks the line there."""
    out_x, out_y = [], []
    for x, y in zip(xs, ys):
        ok = math.isfinite(x) and math.isfinite(y)
        out_x.append(float(x) if ok else math.nan)
        out_y.append(float(y) if ok else math.nan)
    return out_x, out_y


def _series(
    ys: Series | Mapping[str, Series], xs: Series | Mapping[str, Series] | None
) -> list[tuple[str | None, list[float], list[float]]]:
    """(label, xs, ys) per series; a bare sequence is one unlabelled series."""
    if isinstance(ys, Mapping):
        if xs is not None and not isinstance(xs, Mapping):
            raise TypeError("with several series (ys a mapping), xs must be None or a mapping too")
        if xs is not None and set(xs) != set(ys):
            raise ValueError(f"xs and ys name different series: {sorted(xs)} != {sorted(ys)}")
        named = [(label, None if xs is None else xs[label], y) for label, y in ys.items()]
    else:
        if isinstance(xs, Mapping):
            raise TypeError("xs is a mapping but ys is a single series")
        named = [(None, xs, ys)]
    out = []
    for label, x, y in named:
        x = range(len(y)) if x is None else x
        if len(x) != len(y):
            where = f" of series {label!r}" if label is not None else ""
            raise ValueError(f"xs and ys{where} differ in length: {len(x)} != {len(y)}")
        out.append((label, *_finite_or_nan(x, y)))
    if not any(math.isfinite(v) for _, _, y in out for v in y):
        raise ValueError("nothing to plot: ys has no finite values")
    return out


def line_figure(
    ys: Series | Mapping[str, Series],
    *,
    xs: Series | Mapping[str, Series] | None = None,
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "",
    width: int = 640,
    height: int = 400,
) -> Figure:
    """A Figure with ``ys`` against ``xs`` (default 0..n-1) on labelled axes.

    ``ys`` is one series, or a mapping ``{label: series}`` drawn as several lines with a legend
    (``xs`` then None or a mapping with the same keys). Non-finite points are skipped and break
    the line. ``width`` x ``height`` is the size in pixels of the saved image.
    """
    series = _series(ys, xs)
    fig = _new_figure(width, height)
    ax = fig.add_subplot()
    for label, x, y in series:
        few = sum(math.isfinite(v) for v in y) < 2  # a lone point has no line to draw: mark it
        ax.plot(x, y, label=label, linewidth=1.6, marker="o" if few else None)
    _label_axes(ax, title, xlabel, ylabel)
    if all(v.is_integer() for _, x, _ in series for v in x if math.isfinite(v)):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and samples: no 2.5 ticks
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=FONT["ticks"])
    return fig


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e5 and (v == 0 or abs(v) >= 1e-3) else f"{v:.2e}"


def bar_figure(
    labels: Sequence[str], values: Series, *, title: str = "", unit: str = "", xlabel: str = "", width: int = 640
) -> Figure:
    """A Figure of horizontal bars, one row per label (first on top), each followed by its value and
    ``unit``. The height grows with the number of bars."""
    if len(labels) != len(values) or not labels:
        raise ValueError(
            f"need one value per label and at least one bar, got {len(labels)} labels and {len(values)} values"
        )
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"bar values must be finite and >= 0: {list(values)}")
    fig = _new_figure(width, max(MIN_HEIGHT, 90 + BAR_ROW_PX * len(labels)))
    ax = fig.add_subplot()
    bars = ax.barh(range(len(labels)), values, tick_label=list(labels), height=0.6)
    ax.bar_label(bars, labels=[f"{_fmt(v)}{unit}" for v in values], padding=4, fontsize=FONT["ticks"])
    ax.invert_yaxis()
    ax.set_xlim(0, (max(values) or 1.0) * 1.18)  # room for the value after the longest bar
    _label_axes(ax, title, xlabel, "")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG at ``path`` through a temporary file and a rename; parents are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=DPI))
    return path


def save_line_plot(
    path: str | os.PathLike,
    ys: Series | Mapping[str, Series],
    *,
    xs: Series | Mapping[str, Series] | None = None,
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "",
    width: int = 640,
    height: int = 400,
) -> Path:
    """Write `line_figure(...)` as a PNG at ``path`` (atomically; see `save_figure`)."""
    return save_figure(
        line_figure(ys, xs=xs, title=title, xlabel=xlabel, ylabel=ylabel, width=width, height=height), path
    )


def save_bar_chart(
    path: str | os.PathLike,
    labels: Sequence[str],
    values: Series,
    *,
    title: str = "",
    unit: str = "",
    xlabel: str = "",
    width: int = 640,
) -> Path:
    """Write `bar_figure(...)` as a PNG at ``path`` (atomically; see `save_figure`)."""
    return save_figure(bar_figure(labels, values, title=title, unit=unit, xlabel=xlabel, width=width), path)
