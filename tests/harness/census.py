"""An independent census of live tensor memory, for memory tests.

It walks the garbage collector's objects (not the engine's own counters), deduplicates tensors by
their storage, and sums storage bytes: a view or a Parameter sharing storage counts once.
"""

from __future__ import annotations

import gc
import warnings

import torch


def live_tensor_storages(device: str | torch.device | None = None) -> dict[int, int]:
    """Map storage address -> bytes for every live tensor (optionally only on `device`'s type)."""
    want = torch.device(device).type if device is not None else None
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on some deprecated torch objects warns; the census must stay quiet.
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    del objects
    for obj in tensors:
        try:
            if obj.is_meta:
                continue
            if want is not None and obj.device.type != want:
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr:
                storages[ptr] = storage.nbytes()
        except Exception:  # tensor subclasses or half-built objects: not our memory to count
            continue
    return storages


def live_tensor_bytes(device: str | torch.device | None = None, collect: bool = True) -> int:
    """Total bytes of distinct live tensor storages. `collect=False` skips the full garbage collection
    first (a fraction of a second each time with torch imported): tensors only a reference cycle keeps
    then count too, so the number can only be larger — for sampling a peak often against an upper bound."""
    if collect:
        gc.collect()
    return sum(live_tensor_storages(device).values())
