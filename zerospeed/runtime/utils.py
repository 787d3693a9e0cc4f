"""DeepSpeed's `deepspeed.runtime.utils` helpers that client scripts call."""
from __future__ import annotations

import random

import numpy as np
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


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's), as DeepSpeed does."""
    from zerospeed.accelerator import get_accelerator
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


__all__ = ["move_to_device", "set_random_seed"]
