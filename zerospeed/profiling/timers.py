"""Wall-clock timers for the phases of a training step (`wall_clock_breakdown`).

`PhaseTimers` holds named timers; `start(name)` / `stop(name)` bracket a phase (synchronising the
device first, so asynchronous kernels are charged to the phase that launched them). Elapsed times
accumulate until `reset()`; `breakdown()` reports milliseconds per phase with per-step means.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Timer:
    total: float = 0.0
    count: int = 0
    started: float | None = None


class PhaseTimers:
    """Named, restartable wall-clock timers."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter):
        self._sync = synchronize
        self._clock = clock
        self._timers: dict[str, _Timer] = {}

    def start(self, name: str) -> None:
        t = self._timers.setdefault(name, _Timer())
        if t.started is not None:
            raise RuntimeError(f"timer {name!r} is already running; stop it before starting it again")
        self._sync()
        t.started = self._clock()

    def stop(self, name: str) -> float:
        """Stop `name`; returns the seconds of this interval."""
        t = self._timers.get(name)
        if t is None or t.started is None:
            raise RuntimeError(f"timer {name!r} was not started")
        self._sync()
        interval = self._clock() - t.started
        t.total += interval
        t.count += 1
        t.started = None
        return interval

    def elapsed(self, name: str) -> float:
        """Accumulated seconds of `name` (0 when never run)."""
        t = self._timers.get(name)
        return t.total if t else 0.0

    def count(self, name: str) -> int:
        t = self._timers.get(name)
        return t.count if t else 0

    def names(self) -> list[str]:
        return list(self._timers)

    def reset(self) -> None:
        """Forget accumulated times (running timers keep running)."""
        for t in self._timers.values():
            t.total, t.count = 0.0, 0

    def breakdown(self, steps: int = 1) -> dict[str, float]:
        """Milliseconds per step for every timer, over `steps` steps."""
        return {name: 1e3 * t.total / max(steps, 1) for name, t in self._timers.items()}


def format_breakdown(breakdown_ms: dict[str, float], step: int) -> str:
    """One line: 'step 10 time (ms) | forward: 1.23 | backward: ...'."""
    parts = " | ".join(f"{k}: {v:.2f}" for k, v in breakdown_ms.items())
    return f"step {step} time (ms) | {parts}"


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean of `data` without its `trim_percent` smallest and largest values (DeepSpeed's
    `utils.timer.trim_mean`, which the comms logger's averages use); 0 for no data. `data` is not reordered."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    if not data:
        return 0
    ordered = sorted(data)
    cut = round(len(ordered) * trim_percent)
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)
