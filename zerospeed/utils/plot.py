"""Line plots written as PNG files with nothing but the standard library.

Training scripts want a loss curve without pulling in matplotlib, so this module rasterises a
single polyline onto an RGB canvas, labels the axis ranges and the title with a built-in 3x5
bitmap font, and encodes the result as a PNG (``zlib`` + ``struct``).

Geometry (what the tests rely on): the plot area spans columns ``LEFT .. width-RIGHT-1`` and
rows ``TOP .. height-BOTTOM-1``. The smallest x maps to the first column, the largest to the last;
the largest y maps to the top row, the smallest to the bottom row. A constant series is drawn
in the middle row. Axes are drawn just outside the plot area, so they never hide the curve.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["save_line_plot", "save_bar_chart", "render_bar_chart", "encode_png", "Canvas", "LEFT", "RIGHT", "TOP", "BOTTOM", "CURVE_COLOR"]

Color = tuple[int, int, int]

LEFT, RIGHT, TOP, BOTTOM = 80, 16, 28, 28
BACKGROUND: Color = (255, 255, 255)
AXIS_COLOR: Color = (0, 0, 0)
TEXT_COLOR: Color = (60, 60, 60)
CURVE_COLOR: Color = (31, 119, 180)
_FONT_SCALE = 2

# 3x5 glyphs: five rows of three cells ('#' = ink), rows separated by spaces.
# Lowercase text is drawn in uppercase; characters without a glyph are drawn as blanks.
_GLYPH_ROWS: dict[str, str] = {
    "0": "### #.# #.# #.# ###", "1": ".#. ##. .#. .#. ###", "2": "### ..# ### #.. ###",
    "3": "### ..# ### ..# ###", "4": "#.# #.# ### ..# ..#", "5": "### #.. ### ..# ###",
    "6": "### #.. ### #.# ###", "7": "### ..# ..# ..# ..#", "8": "### #.# ### #.# ###",
    "9": "### #.# ### ..# ###", ".": "... ... ... ... .#.", "-": "... ... ### ... ...",
    "+": "... .#. ### .#. ...", ":": "... .#. ... .#. ...", "/": "..# ..# .#. #.. #..",
    "(": ".#. #.. #.. #.. .#.", ")": ".#. ..# ..# ..# .#.", "=": "... ### ... ### ...",
    "_": "... ... ... ... ###", ",": "... ... ... .#. #..", "%": "#.# ..# .#. #.. #.#",
    " ": "... ... ... ... ...",
    "A": ".#. #.# ### #.# #.#", "B": "##. #.# ##. #.# ##.", "C": ".## #.. #.. #.. .##",
    "D": "##. #.# #.# #.# ##.", "E": "### #.. ##. #.. ###", "F": "### #.. ##. #.. #..",
    "G": ".## #.. #.# #.# .##", "H": "#.# #.# ### #.# #.#", "I": "### .#. .#. .#. ###",
    "J": "..# ..# ..# #.# .#.", "K": "#.# #.# ##. #.# #.#", "L": "#.. #.. #.. #.. ###",
    "M": "#.# ### ### #.# #.#", "N": "##. #.# #.# #.# #.#", "O": ".#. #.# #.# #.# .#.",
    "P": "##. #.# ##. #.. #..", "Q": ".#. #.# #.# ##. .##", "R": "##. #.# ##. #.# #.#",
    "S": ".## #.. .#. ..# ##.", "T": "### .#. .#. .#. .#.", "U": "#.# #.# #.# #.# ###",
    "V": "#.# #.# #.# #.# .#.", "W": "#.# #.# ### ### #.#", "X": "#.# #.# .#. #.# #.#",
    "Y": "#.# #.# .#. .#. .#.", "Z": "### ..# .#. #.. ###",
}
_GLYPHS: dict[str, str] = {ch: rows.replace(" ", "") for ch, rows in _GLYPH_ROWS.items()}


class Canvas:
    """A mutable RGB raster with clipped pixel, line and text drawing."""

    def __init__(self, width: int, height: int, background: Color = BACKGROUND) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        """Colour one pixel; coordinates outside the canvas are ignored."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        """The colour of one pixel."""
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i:i + 3])  # type: ignore[return-value]

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A 1-pixel line including both end points (Bresenham, all octants)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.set(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color = TEXT_COLOR, scale: int = _FONT_SCALE) -> None:
        """Draw ``s`` with its top-left corner at (x, y)."""
        for k, ch in enumerate(s.upper()):
            cells = _GLYPHS.get(ch, _GLYPHS[" "])
            for c, ink in enumerate(cells):
                if ink == "#":
                    gx, gy = x + (4 * k + c % 3) * scale, y + (c // 3) * scale
                    for dy in range(scale):
                        for dx in range(scale):
                            self.set(gx + dx, gy + dy, color)


def text_width(s: str, scale: int = _FONT_SCALE) -> int:
    """Pixel width of ``s``: 3-pixel glyphs with 1-pixel gaps, times ``scale``."""
    return max(0, 4 * len(s) - 1) * scale


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """Encode 8-bit RGB pixels (row-major, no padding) as a PNG file's bytes."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"expected {3 * width * height} bytes of RGB for {width}x{height}, got {len(rgb)}")
    stride = 3 * width
    # Each scanline is prefixed with its filter type; 0 (None) keeps the encoder trivial.
    raw = b"".join(b"\x00" + bytes(rgb[r * stride:(r + 1) * stride]) for r in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _axis_range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:  # a flat series gets a unit-wide range centred on it, so it draws mid-height
        return lo - 0.5, hi + 0.5
    return lo, hi


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e5 and (v == 0 or abs(v) >= 1e-3) else f"{v:.2e}"


def render_line_plot(ys: Sequence[float], xs: Sequence[float] | None = None, *, title: str = "",
                     width: int = 640, height: int = 400) -> Canvas:
    """Rasterise the series onto a new canvas (see the module docstring for the geometry).

    Non-finite points (nan, inf) are skipped and break the line.
    """
    xs = list(range(len(ys))) if xs is None else list(xs)
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length: {len(xs)} != {len(ys)}")
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        raise ValueError("nothing to plot: ys has no finite values")
    px0, py0, px1, py1 = LEFT, TOP, width - RIGHT - 1, height - BOTTOM - 1
    if px1 <= px0 or py1 <= py0:
        raise ValueError(f"a {width}x{height} image leaves no room for the plot area; "
                         f"need width > {LEFT + RIGHT + 1} and height > {TOP + BOTTOM + 1}")
    (xlo, xhi), (ylo, yhi) = _axis_range([p[0] for p in pts]), _axis_range([p[1] for p in pts])
    canvas = Canvas(width, height)
    canvas.line(px0 - 1, py0, px0 - 1, py1 + 1, AXIS_COLOR)
    canvas.line(px0 - 1, py1 + 1, px1, py1 + 1, AXIS_COLOR)

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (px0 + math.floor((x - xlo) / (xhi - xlo) * (px1 - px0) + 0.5),
                py1 - math.floor((y - ylo) / (yhi - ylo) * (py1 - py0) + 0.5))

    prev = None
    for x, y in zip(xs, ys):
        cur = to_px(float(x), float(y)) if math.isfinite(x) and math.isfinite(y) else None
        if cur is not None:
            canvas.line(*(prev or cur), *cur, CURVE_COLOR)
        prev = cur
    _draw_labels(canvas, (px0, py0, px1, py1), (xlo, xhi, ylo, yhi), title)
    return canvas


def _draw_labels(canvas: Canvas, area: tuple[int, int, int, int],
                 ranges: tuple[float, float, float, float], title: str) -> None:
    px0, py0, px1, py1 = area
    xlo, xhi, ylo, yhi = ranges
    glyph_h = 5 * _FONT_SCALE
    for y_val, row in ((yhi, py0), (ylo, py1)):
        label = _fmt(y_val)
        canvas.text(px0 - 6 - text_width(label), row - glyph_h // 2, label)
    canvas.text(px0, py1 + 8, _fmt(xlo))
    canvas.text(px1 - text_width(_fmt(xhi)), py1 + 8, _fmt(xhi))
    if title:
        canvas.text((canvas.width - text_width(title)) // 2, (TOP - glyph_h) // 2, title)


BAR_ROW, BAR_GAP = 22, 8  # pixels per bar row, and between rows


def render_bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str = "", unit: str = "",
                     width: int = 640) -> Canvas:
    """Horizontal bars, one row per label, lengths proportional to the (non-negative) values; each
    bar is followed by its value. The label column is as wide as the longest label."""
    if len(labels) != len(values) or not labels:
        raise ValueError(f"need one value per label and at least one bar, got {len(labels)} labels and "
                         f"{len(values)} values")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"bar values must be finite and >= 0: {list(values)}")
    x0 = 8 + max(text_width(label) for label in labels) + 8
    texts = [f"{_fmt(v)}{unit}" for v in values]
    x1 = width - 8 - max(text_width(t) for t in texts) - 8
    if x1 - x0 < 20:
        raise ValueError(f"a {width}-pixel-wide chart leaves no room for the bars; make it wider")
    height = TOP + len(labels) * (BAR_ROW + BAR_GAP) + 8
    canvas = Canvas(width, height)
    top = max(values) or 1.0
    glyph_h = 5 * _FONT_SCALE
    for i, (label, v, t) in enumerate(zip(labels, values, texts)):
        y = TOP + i * (BAR_ROW + BAR_GAP)
        canvas.text(8, y + (BAR_ROW - glyph_h) // 2, label)
        length = math.floor(v / top * (x1 - x0) + 0.5)
        for row in range(y, y + BAR_ROW):
            if length > 0:
                canvas.line(x0, row, x0 + length - 1, row, CURVE_COLOR)
        canvas.text(x0 + length + 6, y + (BAR_ROW - glyph_h) // 2, t)
    canvas.line(x0 - 1, TOP - 2, x0 - 1, height - 6, AXIS_COLOR)
    if title:
        canvas.text((width - text_width(title)) // 2, (TOP - glyph_h) // 2, title)
    return canvas


def save_bar_chart(path: str | os.PathLike, labels: Sequence[str], values: Sequence[float], *, title: str = "",
                   unit: str = "", width: int = 640) -> None:
    """Write a horizontal bar chart PNG at ``path`` (atomically, like `save_line_plot`)."""
    canvas = render_bar_chart(labels, values, title=title, unit=unit, width=width)
    _write_atomic(Path(path), encode_png(canvas.width, canvas.height, canvas.pixels))


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_line_plot(path: str | os.PathLike, ys: Sequence[float], *, xs: Sequence[float] | None = None,
                   title: str = "", width: int = 640, height: int = 400) -> None:
    """Write ``ys`` (against ``xs``, default 0..n-1) as a PNG line plot at ``path``.

    The file is written to a temporary name in the same directory and renamed, so a reader
    never sees a half-written image. Parent directories are created as needed.
    """
    png = encode_png(width, height, render_line_plot(ys, xs, title=title, width=width, height=height).pixels)
    _write_atomic(Path(path), png)
