"""zerospeed.monitor.progress.Progress: a live tqdm bar on a terminal, a few whole lines in a file or log."""

import io
import os

from zerospeed.monitor.progress import Progress


class Terminal(io.StringIO):
    """A stream that says it is a terminal (Progress also asks its width, patched below)."""

    def isatty(self):
        return True

    def fileno(self):
        return 99


def run(steps, **kw):
    clock = iter(range(1000))
    with Progress(steps, "train", clock=lambda: float(next(clock)), **kw) as bar:
        for i in range(steps):
            bar.update(f"loss {10 - i}")
    return bar


def test_a_log_gets_a_few_whole_lines_not_a_redrawn_bar():
    out = io.StringIO()
    run(25, file=out, lines=5)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # every ceil(25 / 5) = 5 steps, the last included; the clock ticks once per line printed
    assert [line.split(" [")[0] for line in lines] == [
        f"train: {p:3d}% {n}/25" for p, n in ((20, 5), (40, 10), (60, 15), (80, 20), (100, 25))
    ]
    assert lines[0] == "train:  20% 5/25 [00:01<00:04,  5.00step/s, loss 6]"
    assert lines[-1].endswith(", loss -14]")


def test_the_last_step_is_always_reported():
    out = io.StringIO()
    run(7, file=out, lines=3)  # every 3 steps: 3, 6, and the last, 7
    assert [line.split(" [")[0].split()[-1] for line in out.getvalue().splitlines()] == ["3/7", "6/7", "7/7"]


def test_a_terminal_gets_one_live_tqdm_bar(monkeypatch):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((100, 40)))
    out = Terminal()
    bar = run(25, file=out)
    assert bar.live and "\r" in out.getvalue()  # redrawn in place
    assert "25/25" in out.getvalue() and "loss -14" in out.getvalue()


def test_a_terminal_without_width_falls_back_to_lines(monkeypatch):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))  # e.g. a bare pty
    out = Terminal()
    assert not run(4, file=out).live and "\r" not in out.getvalue() and out.getvalue().count("\n") == 4


def test_disabled_on_other_ranks_prints_nothing(monkeypatch):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((100, 40)))
    for out in (io.StringIO(), Terminal()):
        run(10, file=out, enabled=False)
        assert out.getvalue() == ""
