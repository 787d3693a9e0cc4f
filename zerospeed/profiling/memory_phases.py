"""Peak memory per phase of the training step, for `"memory_breakdown": true`.

Each phase (forward, backward, reduce, step) resets the accelerator's peak counter when it starts and
reads it when it ends: on a GPU the caching allocator's `max_memory_allocated`, on the CPU the
kernel's own high-water mark of the resident set (Note [host peak memory] in accelerator.py) — both
independent of zerospeed's bookkeeping. The largest value seen for each phase since the last
`reset()` is kept, together with what was resident when the phase began, so a report says which
phase sets the peak and how much it adds on top of the steady state.

"reduce" is the end of a backward: waiting for the gradient reductions still in flight (and at
stage 3 releasing the last gathered units); the reductions that overlap backward count in "backward".
"""

from __future__ import annotations

PHASES = ("forward", "backward", "reduce", "step")
MIB = 1 << 20


class PhasePeaks:
    def __init__(self, accelerator):
        self.acc = accelerator
        self.peak: dict[str, int] = {}
        self.start: dict[str, int] = {}  # resident at the start of the phase whose peak was kept
        self.current: str | None = None
        self._at_start = 0

    def enter(self, phase: str) -> None:
        """Phase `phase` begins now (ending the one before, if any)."""
        self.leave()
        self._at_start = self.acc.memory_allocated()
        self.acc.reset_peak_memory_stats()
        self.current = phase

    def leave(self) -> None:
        if self.current is None:
            return
        peak = self.acc.max_memory_allocated()
        if peak > self.peak.get(self.current, -1):
            self.peak[self.current] = peak
            self.start[self.current] = self._at_start
        self.current = None

    def reset(self) -> None:
        self.peak, self.start = {}, {}

    def report(self) -> str:
        """`forward 2,100 MiB (+900), backward ...` in phase order, the largest marked with `*`."""
        if not self.peak:
            return "no phase measured"
        top = max(self.peak, key=self.peak.get)
        return ", ".join(
            f"{p} {self.peak[p] / MIB:,.0f} MiB (+{(self.peak[p] - self.start[p]) / MIB:,.0f})"
            + ("*" if p == top else "")
            for p in PHASES
            if p in self.peak
        )
