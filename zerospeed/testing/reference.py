"""A plain single-process PyTorch trainer that reproduces a data-parallel run's global batches.

Parity tests train the same model on the same global batches twice: once through zerospeed on N
ranks, once here, and compare losses and final weights.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def split_global_batch(batch: Sequence[torch.Tensor], world_size: int, grad_accum: int,
                       rank: int) -> list[tuple[torch.Tensor, ...]]:
    """Rank `rank`'s micro-batches of one global batch (leading dim = world * grad_accum * micro).

    Convention: micro-step m of rank r takes the (m * world_size + r)-th slice of size micro.
    """
    total = batch[0].shape[0]
    if total % (world_size * grad_accum):
        raise ValueError(f"global batch {total} not divisible by world {world_size} x accumulation {grad_accum}")
    micro = total // (world_size * grad_accum)
    out = []
    for m in range(grad_accum):
        start = (m * world_size + rank) * micro
        out.append(tuple(t[start:start + micro] for t in batch))
    return out


def reference_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    global_batches: Sequence[Sequence[torch.Tensor]], *, world_size: int, grad_accum: int,
                    loss_fn: Callable[..., torch.Tensor] | None = None, scheduler=None,
                    clip: float = 0.0, set_to_none: bool = True) -> list[float]:
    """Train on each global batch as one optimizer step; return the mean micro-batch loss per step.

    Every micro-batch of every (virtual) rank contributes loss / (world_size * grad_accum) to the
    gradient, which is what averaging over ranks and dividing by the accumulation steps gives.
    """
    loss_fn = loss_fn or (lambda m, *b: m(*b))
    n_micro = world_size * grad_accum
    losses = []
    for batch in global_batches:
        optimizer.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for rank in range(world_size):
            for micro in split_global_batch(batch, world_size, grad_accum, rank):
                loss = loss_fn(model, *micro)
                (loss / n_micro).backward()
                total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / n_micro)
    return losses
