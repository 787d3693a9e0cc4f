"""Pure gradient arithmetic used at the optimizer step."""

from __future__ import annotations

import math

import torch


def global_norm(tensors: list[torch.Tensor]) -> float:
    """L2 norm over all elements of all tensors (computed in fp32 or wider)."""
    if not tensors:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return float(torch.linalg.vector_norm(norms))


def clip_coefficient(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """The factor that brings `total_norm` down to `max_norm` (1.0 when already below; 0 = no clip).

    Same rule as torch.nn.utils.clip_grad_norm_: max_norm / (norm + eps), capped at 1.
    """
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + eps))


def reduction_factors(world_size: int, op: str, prescale: bool, predivide_factor: float) -> tuple[float, float]:
    """(before, after) multipliers around a gradient all-reduce-sum, following DeepSpeed's rules.

    avg + prescale: divide by the world size before the sum. avg without prescale: divide by
    `gradient_predivide_factor` before and multiply by factor / world after (fp16 headroom when the
    world is large). sum: no scaling at all.
    """
    if op == "sum":
        return 1.0, 1.0
    if prescale:
        return 1.0 / world_size, 1.0
    return 1.0 / predivide_factor, predivide_factor / world_size
