"""Time spent in checkpointed code: the original forwards, the recomputes, and whole backwards."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from zerospeed.accelerator import get_accelerator

PHASES = ("forward", "recompute", "backward")


@dataclass
class CheckpointProfile:
    """Call counts and seconds per phase. When off, ``measure`` costs nothing but a flag test."""

    enabled: bool = False
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        # Device work is asynchronous: synchronise so the interval covers the kernels, not their launch.
        get_accelerator().synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            get_accelerator().synchronize()
            self.calls[phase] += 1
            self.seconds[phase] += time.perf_counter() - start

    def report(self) -> dict[str, dict[str, float]]:
        return {p: {"calls": self.calls[p], "seconds": self.seconds[p]} for p in PHASES}
