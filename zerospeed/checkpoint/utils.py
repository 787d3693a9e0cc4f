"""DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of `item` (tensors inside lists, tuples and dicts) whose tensors own exactly their
    bytes: `torch.save` of a view writes its whole storage, and a sharded or flat-buffer view may
    sit in a much larger one."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
