"""Input casting: `fp16.auto_cast` casts the floating-point tensors among the forward's inputs to fp16."""

from __future__ import annotations

from typing import Any

import torch


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating-point tensor in it (through lists, tuples and dicts) cast to `dtype`.

    DeepSpeed's `fp16.auto_cast` calls `.half()` on every positional input that has one, integer token
    ids included, which an embedding then refuses; here integer and bool tensors keep their dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(cast_floating(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(v, dtype) for v in obj)
    return obj
