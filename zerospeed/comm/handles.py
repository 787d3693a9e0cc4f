"""Several in-flight collectives waited on as one (DeepSpeed's `MultipleAllGatherHandles`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence


def _takes(wait, name: str) -> bool:
    """Whether `wait` accepts the keyword `name` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(wait).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class MultipleAllGatherHandles:
    """Handles of gathers launched together; `wait()` waits for each in order.

    DeepSpeed's handles take `wait(handle_dependency=...)` (whether to also wait for the compute stream); it
    is passed, by keyword, to each handle that accepts it, and zerospeed's own `comm.Handle.wait()`, which
    takes no arguments (a handle's work orders itself on the stream), is called plainly."""

    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)

    def wait(self, **kwargs) -> None:
        for handle in self.handles:
            passed = {key: value for key, value in kwargs.items() if _takes(handle.wait, key)}
            handle.wait(**passed)
