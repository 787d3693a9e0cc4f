"""Small helpers on nested containers of tensors."""

from __future__ import annotations

import torch


def move_to_device(item, device, criterion_func=None):
    """`item` with every tensor (inside lists, tuples and dicts) moved to `device`; with
    `criterion_func`, only the tensors for which it returns True."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
