"""The optimizer step every ZeRO stage shares: scale the gradients, step in sub-groups."""
from __future__ import annotations

import torch


@torch.no_grad()
def step_in_sub_groups(optimizer: torch.optim.Optimizer, grads: list[tuple[torch.Tensor, torch.Tensor]],
                       coef: float, sub_groups: list[list[int]] | None = None) -> None:
    """Multiply each (master, gradient) pair's gradient by `coef`, then step the optimizer.

    With `sub_groups` (lists of indices into `grads`) the optimizer steps one sub-group at a time:
    torch optimizers skip parameters whose .grad is None, so each step's temporaries cover at most
    `sub_group_size` elements. Gradients are attached only for the duration of their step.
    """
    if coef != 1.0:
        for _, g in grads:
            g.mul_(coef)
    for sub in sub_groups if sub_groups is not None else [range(len(grads))]:
        pairs = [grads[i] for i in sub]
        for m, g in pairs:
            m.grad = g if g.dtype == m.dtype else g.to(m.dtype)
        optimizer.step()
        for m, _ in pairs:
            m.grad = None
