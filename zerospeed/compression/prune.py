"""Pruning masks (1 = keep, 0 = pruned). Pure functions of tensors.

``l1`` masks rank by magnitude (|w| per element for sparse pruning, the L1 norm of each output row
for row pruning); ``topk`` masks rank learnable scores and pass their gradient straight through.
"""
from __future__ import annotations

import math

import torch


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 for the ``ceil(dense_ratio * numel)`` largest scores (first index wins ties), 0 elsewhere."""
    keep = math.ceil(dense_ratio * scores.numel())
    order = torch.sort(scores.detach().flatten(), descending=True, stable=True).indices
    mask = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    mask[order[:keep]] = 1.0
    return mask.view(scores.shape)


def topk_mask_ste(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """``topk_mask`` in forward; in backward the scores get the mask's gradient unchanged."""
    return topk_mask(scores, dense_ratio) + (scores - scores.detach())


def sparse_l1_mask(weight: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """Keep the largest-magnitude fraction of the elements of ``weight``."""
    return topk_mask(weight.detach().abs(), dense_ratio)


def row_l1_mask(weight_OI: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """``(O, 1)``: keep the output rows with the largest L1 norms."""
    return topk_mask(weight_OI.detach().abs().sum(dim=1), dense_ratio).view(-1, 1)
