"""Pruning masks (1 = keep, 0 = pruned). Pure functions of tensors.

``l1`` masks rank by magnitude: |w| per element for sparse pruning, the L1 norm of each output row
for row pruning, of each head's input columns of the attention output projection for head pruning,
of each output channel's kernel for channel pruning. ``topk`` masks rank learnable scores of the
same shape and pass their gradient straight through.
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


def head_l1_mask(weight_OI: torch.Tensor, num_heads: int, dense_ratio: float) -> torch.Tensor:
    """``(1, num_heads)``: keep the heads whose input-column blocks of the attention output projection
    (head ``h`` owns columns ``h*d .. (h+1)*d - 1``, ``d = in / num_heads``) have the largest L1 norms."""
    norms = weight_OI.detach().abs().reshape(weight_OI.shape[0], num_heads, -1).sum(dim=(0, 2))
    return topk_mask(norms, dense_ratio).view(1, -1)


def channel_l1_mask(weight_OCHW: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """``(O, 1, 1, 1)``: keep the convolution's output channels with the largest L1 norms."""
    return topk_mask(weight_OCHW.detach().abs().sum(dim=(1, 2, 3)), dense_ratio).view(-1, 1, 1, 1)


def expand_head_mask(mask_1H: torch.Tensor, in_features: int) -> torch.Tensor:
    """The ``(1, in)`` column mask of a ``(1, H)`` head mask (each head's ``in / H`` columns)."""
    return mask_1H.repeat_interleave(in_features // mask_1H.shape[1], dim=1)
