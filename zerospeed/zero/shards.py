"""What a rank holds of the trainable state, as a layout-independent map (for checkpoints).

Each `ShardEntry` is one tensor the optimizer steps on this rank (an fp32 master: a whole parameter at
stage 0, a bucket chunk at stages 1-2) plus the pieces of named parameters it holds. Saving writes
entries and their optimizer state; consolidating or resharding only needs these maps, never the
layout that produced them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Elements [param_offset, +numel) of the flattened parameter `name` at [offset, +numel) of the entry."""

    name: str
    param_offset: int
    offset: int
    numel: int


@dataclass
class ShardEntry:
    master: torch.Tensor
    pieces: list[Piece]


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its (first) qualified name; a tied parameter gets one name."""
    return {id(p): n for n, p in module.named_parameters()}


@torch.no_grad()
def fill_entry(entry_tensor: torch.Tensor, pieces: list[Piece], full: dict[str, torch.Tensor]) -> None:
    """Write the pieces of full (named, any shape) tensors into a flat view of `entry_tensor`."""
    flat = entry_tensor.view(-1)
    for p in pieces:
        flat[p.offset : p.offset + p.numel].copy_(full[p.name].reshape(-1)[p.param_offset : p.param_offset + p.numel])
