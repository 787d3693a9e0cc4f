"""Tests for the matplotlib plots (zerospeed.monitor.plot): the Figure carries the data and labels asked
for, and the PNG written is that Figure, at the requested pixel size, written atomically."""

import math
import sys

import matplotlib.image  # the `plots` extra, part of the `test` extra
import numpy as np
import pytest

from zerospeed.monitor.plot import bar_figure, line_figure, save_bar_chart, save_line_plot


def rendered(fig) -> np.ndarray:
    """The figure's RGBA pixels as Agg draws them (what savefig encodes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())


def test_line_figure_plots_the_series_with_the_labels_asked_for():
    fig = line_figure([3.0, 2.5, 1.0], xs=[10, 20, 30], title="loss", xlabel="optimizer step", ylabel="loss")
    (ax,) = fig.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("loss", "optimizer step", "loss")
    (line,) = ax.lines
    assert list(line.get_xdata()) == [10, 20, 30] and list(line.get_ydata()) == [3.0, 2.5, 1.0]
    assert ax.get_legend() is None  # one series: nothing to tell apart
    assert all(float(t).is_integer() for t in ax.get_xticks())  # integer steps get integer ticks


def test_default_xs_count_from_zero():
    (line,) = line_figure([5.0, 4.0, 3.0, 2.0]).axes[0].lines
    assert list(line.get_xdata()) == [0, 1, 2, 3]


def test_several_series_get_one_line_each_and_a_legend():
    fig = line_figure(
        {"rank 0": [1.0, 2.0], "rank 1": [1.5, 2.5, 3.5]}, xs={"rank 0": [4, 8], "rank 1": [4, 8, 12]}, ylabel="MiB"
    )
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["rank 0", "rank 1"]
    assert [list(line.get_ydata()) for line in ax.lines] == [[1.0, 2.0], [1.5, 2.5, 3.5]]
    assert list(ax.lines[1].get_xdata()) == [4, 8, 12]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rank 0", "rank 1"]


def test_non_finite_points_become_gaps():
    (line,) = line_figure([1.0, math.nan, 2.0, math.inf, 3.0]).axes[0].lines
    ys = list(line.get_ydata())
    assert ys[0::2] == [1.0, 2.0, 3.0] and math.isnan(ys[1]) and math.isnan(ys[3])
    assert math.isnan(list(line.get_xdata())[3])  # the x of an infinite y is dropped too


def test_saved_png_is_the_figure_at_the_requested_size(tmp_path):
    path = tmp_path / "loss.png"
    save_line_plot(path, [3.0, 2.0, 1.0], title="t", xlabel="step", ylabel="loss", width=321, height=123)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape == (123, 321, 4)
    expected = rendered(line_figure([3.0, 2.0, 1.0], title="t", xlabel="step", ylabel="loss", width=321, height=123))
    np.testing.assert_array_equal(np.round(image * 255).astype(np.uint8), expected)
    other = rendered(line_figure([1.0, 2.0, 3.0], title="t", xlabel="step", ylabel="loss", width=321, height=123))
    assert (other != expected).any()  # the comparison above can tell plots apart


def test_write_is_atomic_and_creates_parents(tmp_path):
    path = tmp_path / "runs" / "demo" / "loss.png"
    save_line_plot(path, [1.0, 2.0], width=200, height=150)
    save_line_plot(path, [2.0, 1.0], width=240, height=150)  # overwrite in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["loss.png"]  # no temporary file left
    assert matplotlib.image.imread(path).shape == (150, 240, 4)


def test_a_failing_write_keeps_the_old_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    path = tmp_path / "loss.png"
    save_line_plot(path, [1.0, 2.0])
    before = path.read_bytes()

    def broken(self, f, **kw):
        f.write(b"half an image")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        save_line_plot(path, [2.0, 1.0])
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["loss.png"]


@pytest.mark.parametrize(
    "ys, kw, exc, message",
    [
        ([], {}, ValueError, "nothing to plot: ys has no finite values"),
        ([math.nan, math.inf], {}, ValueError, "nothing to plot"),
        ([1.0, 2.0], {"xs": [0.0]}, ValueError, r"xs and ys differ in length: 1 != 2"),
        (
            {"a": [1.0], "b": [1.0, 2.0]},
            {"xs": {"a": [0], "b": [0]}},
            ValueError,
            r"xs and ys of series 'b' differ in length: 1 != 2",
        ),
        ({"a": [1.0]}, {"xs": {"b": [0]}}, ValueError, r"xs and ys name different series: \['b'\] != \['a'\]"),
        ({"a": [1.0]}, {"xs": [0]}, TypeError, "xs must be None or a mapping too"),
        ([1.0], {"xs": {"a": [0]}}, TypeError, "xs is a mapping but ys is a single series"),
        ([1.0], {"width": 159}, ValueError, r"a 159x400 image is too small for labelled axes; use at least 160x120"),
        ([1.0], {"height": 119}, ValueError, r"a 640x119 image is too small"),
    ],
)
def test_errors_write_nothing(tmp_path, ys, kw, exc, message):
    with pytest.raises(exc, match=message):
        save_line_plot(tmp_path / "x.png", ys, **kw)
    assert list(tmp_path.iterdir()) == []


def test_bar_chart_bars_labels_and_values():
    fig = bar_figure(["zs2", "zs3_cpu"], [50.0, 100.0], title="median step", unit=" ms", xlabel="step time (ms)")
    ax = fig.axes[0]
    assert (ax.get_title(), ax.get_xlabel()) == ("median step", "step time (ms)")
    assert [p.get_width() for p in ax.patches] == [50.0, 100.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["zs2", "zs3_cpu"]
    assert ax.patches[0].get_y() < ax.patches[1].get_y() and ax.yaxis_inverted()  # first bar on top
    assert [t.get_text() for t in ax.texts] == ["50 ms", "100 ms"]  # each bar's value after it
    assert ax.get_xlim()[1] > 100.0  # room for the value label after the longest bar


def test_bar_chart_file_grows_with_the_bars(tmp_path):
    save_bar_chart(tmp_path / "two.png", ["a", "b"], [1.0, 0.0], width=500)
    save_bar_chart(tmp_path / "four.png", ["a", "b", "c", "d"], [1.0, 2.0, 3.0, 4.0], width=500)
    two, four = (matplotlib.image.imread(tmp_path / n) for n in ("two.png", "four.png"))
    assert two.shape[1] == four.shape[1] == 500 and four.shape[0] > two.shape[0]


def test_bar_chart_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="one value per label"):
        save_bar_chart(tmp_path / "x.png", ["a"], [1.0, 2.0])
    with pytest.raises(ValueError, match=">= 0"):
        save_bar_chart(tmp_path / "x.png", ["a"], [-1.0])
    assert list(tmp_path.iterdir()) == []


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure now fails
    with pytest.raises(ImportError, match=r"pip install 'zerospeed\[plots\]'"):
        save_line_plot(tmp_path / "x.png", [1.0, 2.0])


def test_import_zerospeed_plot_does_not_import_matplotlib():
    import subprocess

    code = "import sys, zerospeed.monitor.plot; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
