"""Small helpers on tensors: nested containers, and the parameters a running backward reaches."""

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


def count_used_parameters_in_backward(parameters) -> int:
    """How many of `parameters` the backward now running will produce a gradient for (DeepSpeed's
    `runtime.utils.count_used_parameters_in_backward`; call it from a hook during backward).

    A parameter counts when autograd's engine will execute its gradient node (its accumulator, or
    the grad_fn of a non-leaf) in the current graph task; parameters that share a node count once,
    and ones that need no gradient are skipped.
    """
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called while a backward is running")
    seen: set = set()
    used = 0
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        with torch.enable_grad():  # hooks run with grad mode off; looking up a leaf's accumulator needs it on
            node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
        if node is None or node in seen:
            continue
        seen.add(node)
        used += bool(torch._C._will_engine_execute_node(node))
    return used
