"""Peak allocated bytes from the torch profiler's allocator events: an independent measurement.

Under `torch.profiler.profile(profile_memory=True)` the CPU allocator reports every allocation and
free (with its size; frees negative) to the profiler — inside autograd's backward, in hooks, in
storage resizes. Sorted by time, their running sum is the bytes allocated since profiling began; its
maximum over a window is that window's peak, the number a GPU's `max_memory_allocated` reports
(without the caching allocator's block rounding). Frees of memory allocated before profiling began
are left out (they would count a previous run's late-collected tensors against this one). Nothing
here asks zerospeed for its sizes.

    with AllocationTrace() as trace:
        build model, train ...
        with trace.window("step"):   # a torch.profiler.record_function range
            ...
    trace.peak("step"), trace.peak()
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class AllocationTrace:
    """Profile allocations; `peak(name)` is the running-sum maximum inside the windows named `name`."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._events: list[tuple[int, int]] | None = None
        self._windows: dict[str, list[tuple[int, int]]] = {}

    def __enter__(self) -> "AllocationTrace":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        self._read()

    @staticmethod
    @contextlib.contextmanager
    def window(name: str):
        with record_function(f"alloc_window::{name}"):
            yield

    def _read(self) -> None:
        from torch._C._profiler import _EventType
        allocs, windows, todo = [], {}, list(self._prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
            elif e.name.startswith("alloc_window::"):
                windows.setdefault(e.name.split("::", 1)[1], []).append((e.start_time_ns, e.end_time_ns))
            todo.extend(e.children)
        allocs.sort()
        # a free of memory allocated before profiling began (a previous run's tensors, collected late)
        # is not this run's: counting it would lower every later running sum
        live, events = set(), []
        for t, size, ptr in allocs:
            if size > 0:
                live.add(ptr)
            elif ptr in live:
                live.discard(ptr)
            else:
                continue
            events.append((t, size, ptr))
        self._events, self._windows = events, windows

    def peak(self, name: str | None = None) -> int:
        """Max bytes allocated (since profiling began) at any moment inside `name`'s windows (or ever)."""
        spans = sorted(self._windows.get(name, [])) if name is not None else None
        if name is not None and not spans:
            raise KeyError(f"no window named {name!r} was recorded")
        run = best = 0
        for t, size, _ in self._events:
            run += size
            if spans is None or any(lo <= t <= hi for lo, hi in spans):
                best = max(best, run)
        return best

    def at_start(self, name: str) -> int:
        """Bytes allocated when the first window named `name` began."""
        lo = min(self._windows[name])[0]
        return sum(size for t, size, _ in self._events if t < lo)
