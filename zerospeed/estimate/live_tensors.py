"""A census of live tensor memory, independent of the engine's own counters (for ``--measure``).

The garbage collector's view of every live ``torch.Tensor``, deduplicated by storage: a view, a
Parameter and its ``.data`` share one storage and count once. What the engine believes it holds is
not consulted, so comparing this census with the formulas checks both.
"""

from __future__ import annotations

import gc
import warnings

import torch


def live_storages() -> dict[int, int]:
    """Storage address -> bytes, for every live tensor with a real (non-meta, non-empty) storage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some deprecated torch objects warns
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages: dict[int, int] = {}
    for tensor in tensors:
        try:
            if tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
        except Exception:  # tensor subclasses without a storage of their own, half-built objects
            continue
        if storage.data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def live_tensor_bytes() -> int:
    """Bytes of the distinct live tensor storages, after a full collection (cycles freed first)."""
    gc.collect()
    return sum(live_storages().values())
