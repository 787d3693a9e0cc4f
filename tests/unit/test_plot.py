"""Tests for the dependency-free PNG line plot writer (zerospeed.utils.plot).

The PNG is decoded here independently (chunk walk, CRC check, zlib, filter-0 scanlines) so the
tests check the file a viewer would read, not the writer's internal canvas.
"""

import math
import struct
import zlib

import pytest

from zerospeed.utils.plot import CURVE_COLOR, Canvas, encode_png, save_line_plot

AXIS = (0, 0, 0)
WHITE = (255, 255, 255)


def decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = []
    for r in range(height):
        line = raw[r * stride:(r + 1) * stride]
        assert line[0] == 0  # filter type None
        rows.append([tuple(line[1 + 3 * c:4 + 3 * c]) for c in range(width)])
    return width, height, rows


def plot_pixels(tmp_path, ys, **kw):
    path = tmp_path / "p.png"
    save_line_plot(path, ys, **kw)
    return decode_png(path.read_bytes())


def curve(rows) -> set[tuple[int, int]]:
    return {(x, y) for y, row in enumerate(rows) for x, c in enumerate(row) if c == CURVE_COLOR}


# Geometry for a 200x101 image: plot columns 80..183 (200-16-1), rows 28..72 (101-28-1).
X0, X1, Y0, Y1 = 80, 183, 28, 72


def test_png_signature_and_ihdr_size(tmp_path):
    path = tmp_path / "loss.png"
    save_line_plot(path, [3.0, 2.0, 1.0], width=321, height=123)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (321, 123)
    width, height, rows = decode_png(data)
    assert (width, height, len(rows), len(rows[0])) == (321, 123, 123, 321)


def test_constant_series_is_horizontal_line_at_mid_height(tmp_path):
    _, _, rows = plot_pixels(tmp_path, [2.5] * 7, width=200, height=101)
    # y range becomes [2.0, 3.0]; 2.5 maps halfway: row 72 - 44/2 = 50.
    assert curve(rows) == {(x, 50) for x in range(X0, X1 + 1)}


def test_increasing_series_runs_corner_to_corner(tmp_path):
    _, _, rows = plot_pixels(tmp_path, [0.0, 1.0, 2.0, 3.0, 4.0], width=200, height=101)
    pix = curve(rows)
    assert (X0, Y1) in pix and (X1, Y0) in pix
    # x = 1 of 0..4: column 80 + round(103/4) = 106, row 72 - round(44/4) = 61.
    assert (106, 61) in pix
    # A shallow line: exactly one pixel per column, rising (row falls) left to right.
    by_col = sorted(pix)
    assert [x for x, _ in by_col] == list(range(X0, X1 + 1))
    ys = [y for _, y in by_col]
    assert ys == sorted(ys, reverse=True)


def test_explicit_xs_map_min_to_left_and_max_to_right(tmp_path):
    _, _, rows = plot_pixels(tmp_path, [1.0, 0.0], xs=[20.0, 10.0], width=200, height=101)
    pix = curve(rows)
    # (x=10, y=0) is bottom-left, (x=20, y=1) is top-right.
    assert (X0, Y1) in pix and (X1, Y0) in pix
    assert min(x for x, _ in pix) == X0 and max(x for x, _ in pix) == X1


def test_non_finite_points_are_skipped_and_break_the_line(tmp_path):
    _, _, rows = plot_pixels(tmp_path, [1.0, math.nan, 1.0, 1.0], width=200, height=101)
    # Finite points at x = 0, 2, 3 of 0..3 -> columns 80, 80 + round(103*2/3) = 149, 183.
    # Point 0 stands alone (its neighbour is nan); 2 and 3 are joined.
    assert curve(rows) == {(X0, 50)} | {(x, 50) for x in range(149, X1 + 1)}


def test_axes_sit_just_outside_the_plot_area(tmp_path):
    _, _, rows = plot_pixels(tmp_path, [1.0, 2.0], width=200, height=101)
    assert all(rows[y][X0 - 1] == AXIS for y in range(Y0, Y1 + 2))
    assert all(rows[Y1 + 1][x] == AXIS for x in range(X0 - 1, X1 + 1))
    assert rows[Y0][X1] != AXIS and rows[Y1 + 2][X0 + 1] == WHITE


def _inked(rows, x_range, y_range) -> int:
    return sum(rows[y][x] != WHITE for y in y_range for x in x_range)


def test_labels_and_title_are_drawn(tmp_path):
    _, _, plain = plot_pixels(tmp_path, [1.0, 2.0], width=200, height=101)
    _, _, titled = plot_pixels(tmp_path, [1.0, 2.0], title="loss", width=200, height=101)
    top = range(0, Y0 - 6)  # the y-max label is centred on row Y0
    assert _inked(plain, range(200), top) == 0
    assert _inked(titled, range(200), top) > 0
    assert _inked(plain, range(0, X0 - 1), range(Y0 - 6, Y0 + 6)) > 0   # y max label
    assert _inked(plain, range(0, X0 - 1), range(Y1 - 6, Y1 + 6)) > 0   # y min label
    assert _inked(plain, range(X0, 200), range(Y1 + 2, 101)) > 0       # x labels


def test_write_is_atomic_and_creates_parents(tmp_path):
    path = tmp_path / "runs" / "demo" / "loss.png"
    save_line_plot(path, [1.0, 2.0], width=120, height=80)
    save_line_plot(path, [2.0, 1.0], width=130, height=80)  # overwrite in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["loss.png"]
    assert decode_png(path.read_bytes())[0] == 130


@pytest.mark.parametrize("ys, kw, message", [
    ([], {}, "nothing to plot: ys has no finite values"),
    ([math.nan, math.inf], {}, "nothing to plot"),
    ([1.0, 2.0], {"xs": [0.0]}, r"xs and ys differ in length: 1 != 2"),
    ([1.0], {"width": 97}, r"a 97x400 image leaves no room for the plot area; need width > 97"),
    ([1.0], {"height": 57}, r"need width > 97 and height > 57"),
])
def test_errors(tmp_path, ys, kw, message):
    with pytest.raises(ValueError, match=message):
        save_line_plot(tmp_path / "x.png", ys, **kw)
    assert list(tmp_path.iterdir()) == []


def test_encode_png_rejects_wrong_pixel_count():
    with pytest.raises(ValueError, match="expected 12 bytes of RGB for 2x2, got 11"):
        encode_png(2, 2, bytes(11))


def test_encode_png_round_trips_pixels():
    pixels = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30])
    _, _, rows = decode_png(encode_png(2, 2, pixels))
    assert rows == [[(255, 0, 0), (0, 255, 0)], [(0, 0, 255), (10, 20, 30)]]


@pytest.mark.parametrize("start, end", [((0, 0), (4, 4)), ((4, 4), (0, 0)), ((0, 4), (4, 0))])
def test_canvas_line_diagonals_in_any_direction(start, end):
    c = Canvas(5, 5)
    c.line(*start, *end, (1, 2, 3))
    inked = {(x, y) for x in range(5) for y in range(5) if c.get(x, y) == (1, 2, 3)}
    step_x = 1 if end[0] > start[0] else -1
    step_y = 1 if end[1] > start[1] else -1
    assert inked == {(start[0] + i * step_x, start[1] + i * step_y) for i in range(5)}


def test_canvas_clips_outside_pixels():
    c = Canvas(3, 3)
    c.line(-5, 1, 10, 1, (9, 9, 9))
    assert [c.get(x, 1) for x in range(3)] == [(9, 9, 9)] * 3
    assert c.get(0, 0) == WHITE


def test_bar_chart_lengths_are_proportional_to_the_values():
    from zerospeed.utils.plot import BAR_GAP, BAR_ROW, CURVE_COLOR, TOP, render_bar_chart
    canvas = render_bar_chart(["a", "bb"], [50.0, 100.0], title="t", unit=" ms")
    lengths = []
    for i in range(2):
        y = TOP + i * (BAR_ROW + BAR_GAP) + BAR_ROW // 2
        lengths.append(sum(1 for x in range(canvas.width) if canvas.get(x, y) == CURVE_COLOR))
    assert lengths[1] > 100 and abs(lengths[0] * 2 - lengths[1]) <= 2


def test_bar_chart_rejects_bad_input(tmp_path):
    import pytest
    from zerospeed.utils.plot import save_bar_chart
    with pytest.raises(ValueError, match="one value per label"):
        save_bar_chart(tmp_path / "x.png", ["a"], [1.0, 2.0])
    with pytest.raises(ValueError, match=">= 0"):
        save_bar_chart(tmp_path / "x.png", ["a"], [-1.0])
    save_bar_chart(tmp_path / "ok.png", ["a", "b"], [1.0, 0.0])
    assert (tmp_path / "ok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
