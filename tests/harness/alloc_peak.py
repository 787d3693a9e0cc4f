"""Peak allocated bytes from the torch profiler's allocator events: an independent measurement.

Under `torch.profiler.profile(profile_memory=True)` the CPU allocator reports every allocation and
free (with its size; frees negative) to the profiler — inside autograd's backward, in hooks, in
storage resizes. Sorted by time, their running sum is the bytes allocated since profiling began; its
maximum over a window is that window's peak, the number a GPU's `max_memory_allocated` reports
(without the caching allocator's block rounding). Frees of memory allocated before profiling began
are left out (they would count a previous run's late-collected tensors against this one). Nothing
here asks zerospeed for its sizes.

Note [frees on other threads]: the profiler records only the threads it profiles (its
`profile_all_threads` option records no allocations at all in torch 2.13, and the allocator's own
running total is kept only on profiled threads too), so a block whose last reference dies on a worker
thread — gloo's worker frees its own copy of a reduce-scatter's input, and any tensor a finished
collective held last — is freed without an event. Left alone, the running sum keeps every such block
for ever (a ZeRO-2 step's peak rose ~3 MiB a step on two gloo ranks). Such a block is proven freed
when the allocator hands its address out again while it still looks live, and, with
`AllocationTrace(released=True)` (the caller drops everything it allocated before the trace ends),
when it is still live at the end. Either way it is taken as freed when the nearest enclosing operation
that is not an `aten::` op (the collective's call, the gradient hook) ended: the moment the calling
thread let go of it. (gloo's own copy then vanishes when the call returns; NCCL makes none.)
"""

from __future__ import annotations

import contextlib
import gc

from torch.profiler import ProfilerActivity, profile, record_function


class AllocationTrace:
    """Profile allocations; `peak(name)` is the running-sum maximum inside the windows named `name`."""

    def __init__(self, released: bool = False) -> None:
        """`released`: everything allocated in the trace is freed before it ends, so a block still live
        then was freed unrecorded on another thread (Note [frees on other threads])."""
        self._released = released
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._events: list[tuple[int, int]] | None = None
        self._windows: dict[str, list[tuple[int, int]]] = {}

    def __enter__(self) -> AllocationTrace:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._released:
            gc.collect()  # what only cycles still hold is freed here, on this thread, and recorded
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
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, _let_go(e)))
            elif e.name.startswith("alloc_window::"):
                windows.setdefault(e.name.split("::", 1)[1], []).append((e.start_time_ns, e.end_time_ns))
            todo.extend(e.children)
        allocs.sort(key=lambda a: a[:3])
        # a free of memory allocated before profiling began (a previous run's tensors, collected late)
        # is not this run's: counting it would lower every later running sum
        live, events = {}, []
        for t, size, ptr, let_go in allocs:
            if size > 0:
                if ptr in live:  # freed unrecorded: Note [frees on other threads]
                    events += _freed_at(*live[ptr], before=t)
                live[ptr] = (ptr, size, let_go)
            elif ptr in live:
                del live[ptr]
            else:
                continue
            events.append((t, size, ptr))
        if self._released:
            events += [e for block in live.values() for e in _freed_at(*block)]
        events.sort()
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


def _let_go(alloc) -> int | None:
    """When the allocating thread let go of `alloc` if its free went unrecorded: the end of the nearest
    enclosing operation that is not an aten:: op (Note [frees on other threads]); None for a block
    allocated outside every operation, which the calling code may have held for any length of time."""
    p = alloc.parent
    while p is not None and p.name.startswith("aten::"):
        p = p.parent
    return p.end_time_ns if p is not None else None


def _freed_at(ptr: int, size: int, let_go: int | None, before: int | None = None) -> list[tuple[int, int, int]]:
    """The free event of a block whose free went unrecorded (none: held to the end)."""
    t = min(x for x in (let_go, before) if x is not None) if (let_go, before) != (None, None) else None
    return [] if t is None else [(t, -size, ptr)]
