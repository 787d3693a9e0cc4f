"""DeepSpeed's `runtime.utils.see_memory_usage`: one log line of this process's memory, on rank 0."""

from __future__ import annotations

from zerospeed.accelerator import get_accelerator
from zerospeed.utils.logging import log_dist

_GB = 2**30


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with the accelerator's allocated / peak / reserved memory (GB) on rank 0, then start a
    new peak. Does nothing unless `force` (DeepSpeed's switch: callers leave these calls in their code)."""
    if not force:
        return
    acc = get_accelerator()
    log_dist(
        f"{message} | allocated {acc.memory_allocated() / _GB:.2f} GB, peak {acc.max_memory_allocated() / _GB:.2f} "
        f"GB, reserved {acc.memory_reserved() / _GB:.2f} GB",
        ranks=[0],
    )
    acc.reset_peak_memory_stats()
