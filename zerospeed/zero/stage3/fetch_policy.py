"""Pure stage-3 fetch policy: which units to prefetch, and whether to keep a unit after a use.

Note [stage-3 prefetch order]: every fetch in a micro-step is recorded (unit indices, in order).
From the next micro-step on, fetching the k-th unit of the recording (and it matching) prefetches
the following units, up to `prefetch_budget` elements in flight and `max_live` elements resident,
looking no further ahead than the prefetch budget. A fetch that does not match the recording stops
prefetching for the rest of that micro-step, and the new recording replaces the old one:
control-flow changes cost speed, never correctness.

Note [stage-3 reuse distance]: after a use, a unit stays gathered when the recording uses it again
within `max_reuse_distance` elements of other gathers (and the live total is within `max_live`);
otherwise it is released at once. With `max_reuse_distance: 0` every unit is freed after each use.

Everything here is integers: the strategy asks, this module answers; it is tested without processes.
"""

from __future__ import annotations

from collections.abc import Callable


class FetchSchedule:
    def __init__(self, sizes: list[int], *, prefetch_budget: int, max_live: int, max_reuse_distance: int):
        self.sizes = sizes  # padded elements of each unit, by unit index
        self.prefetch_budget = prefetch_budget
        self.max_live = max_live
        self.max_reuse_distance = max_reuse_distance
        self.recorded: list[int] = []
        self.recording: list[int] = []
        self.prefetching = False
        self._next_use: list[int] = []  # for each position of the recording: the unit's next position
        self._cum: list[int] = [0]  # prefix sums of sizes along the recording
        self._last_pos: dict[int, int] = {}  # unit -> its latest position this micro-step

    def start_micro_step(self) -> None:
        """Before a forward: the last micro-step's fetches become the order to prefetch by."""
        if self.recording:
            self.recorded = self.recording
            self._index_recording()
        self.recording = []
        self._last_pos = {}
        self.prefetching = bool(self.recorded)

    def _index_recording(self) -> None:
        rec = self.recorded
        self._next_use = [-1] * len(rec)
        seen: dict[int, int] = {}
        for k in range(len(rec) - 1, -1, -1):
            self._next_use[k] = seen.get(rec[k], -1)
            seen[rec[k]] = k
        self._cum = [0]
        for idx in rec:
            self._cum.append(self._cum[-1] + self.sizes[idx])

    def record(self, unit: int) -> None:
        """A fetch of `unit` now; a fetch off the recorded order stops prefetching (this micro-step)."""
        k = len(self.recording)
        self.recording.append(unit)
        self._last_pos[unit] = k
        if self.prefetching and (k >= len(self.recorded) or self.recorded[k] != unit):
            self.prefetching = False

    def to_prefetch(self, is_sharded: Callable[[int], bool], in_flight: int, live: int) -> list[int]:
        """Units to gather ahead of use now, given the elements in flight and resident."""
        if not self.prefetching:
            return []
        ahead, window = [], 0
        for idx in self.recorded[len(self.recording) :]:
            size = self.sizes[idx]
            window += size  # look no further ahead than the prefetch budget, gathered or not
            if window > self.prefetch_budget:
                break
            if not is_sharded(idx) or idx in ahead:
                continue
            if in_flight + size > self.prefetch_budget or live + size > self.max_live:
                break
            ahead.append(idx)
            in_flight += size
            live += size
        return ahead

    def keep_after_use(self, unit: int, live: int) -> bool:
        """Note [stage-3 reuse distance]: keep `unit` gathered after this use?"""
        k = self._last_pos.get(unit)
        if not self.prefetching or k is None or k >= len(self._next_use):
            return False
        nxt = self._next_use[k]
        return nxt >= 0 and self._cum[nxt] - self._cum[k + 1] <= self.max_reuse_distance and live <= self.max_live
