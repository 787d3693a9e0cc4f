"""Phase timers (wall_clock_breakdown) with a fake clock, and the comm report on STATS snapshots."""

import pytest

from zerospeed.comm.stats import CommStats
from zerospeed.profiling.comms_report import comm_rows, diff_snapshots, format_comm_report
from zerospeed.profiling.timers import PhaseTimers, format_breakdown


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_timers_accumulate_and_break_down_per_step():
    clock, syncs = FakeClock(), []
    timers = PhaseTimers(synchronize=lambda: syncs.append(1), clock=clock)
    for fwd, bwd in ((0.010, 0.020), (0.030, 0.040)):
        timers.start("forward")
        clock.t += fwd
        timers.stop("forward")
        timers.start("backward")
        clock.t += bwd
        assert timers.stop("backward") == pytest.approx(bwd)
    assert timers.elapsed("forward") == pytest.approx(0.040) and timers.count("forward") == 2
    assert timers.breakdown(steps=2) == pytest.approx({"forward": 20.0, "backward": 30.0})
    assert len(syncs) == 8  # the device is synchronised at every start and stop
    timers.reset()
    assert timers.elapsed("forward") == 0.0 and timers.names() == ["forward", "backward"]
    assert format_breakdown({"forward": 1.234, "step": 5.0}, 7) == "step 7 time (ms) | forward: 1.23 | step: 5.00"


def test_timer_misuse_errors():
    timers = PhaseTimers()
    with pytest.raises(RuntimeError, match="timer 'x' was not started"):
        timers.stop("x")
    timers.start("x")
    with pytest.raises(RuntimeError, match="timer 'x' is already running"):
        timers.start("x")


def test_comm_report_bandwidths():
    stats = CommStats()
    before = stats.snapshot()
    stats.record("all_reduce", 1_000_000_000, 2.0, world_size=4)  # wire 2*3/4 of the payload
    stats.record("all_gather", 400_000_000, 0.5, world_size=4)
    stats.record("all_gather", 400_000_000, 0.5, world_size=4)
    delta = diff_snapshots(stats.snapshot(), before)
    rows = {r["kind"]: r for r in comm_rows(delta)}
    assert rows["all_reduce"] == pytest.approx(
        {"kind": "all_reduce", "calls": 1, "MB": 1000.0, "mean_ms": 2000.0, "algbw_GBps": 0.5, "busbw_GBps": 0.75}
    )
    assert rows["all_gather"]["calls"] == 2 and rows["all_gather"]["busbw_GBps"] == pytest.approx(0.6)
    assert [r["kind"] for r in comm_rows(delta, kinds=["all_gather"])] == ["all_gather"]
    text = format_comm_report(delta)
    assert text.splitlines()[1].split() == ["all_gather", "2", "800.000", "500.000", "0.800", "0.600"]
    # nothing new since a snapshot: no rows
    assert diff_snapshots(stats.snapshot(), stats.snapshot()) == {}
