"""DeepSpeed's LR schedule formulas as pure functions of the step and the schedule's parameters.

``step`` is DeepSpeed's ``last_batch_iteration``: -1 right after construction, 0 after the first
``scheduler.step()``, and so on. The stateful wrappers live in ``schedulers.py``.
"""

from __future__ import annotations

import math

__all__ = [
    "WARMUP_TYPES",
    "effective_warmup_steps",
    "lr_range_test_lr",
    "one_cycle_lr",
    "one_cycle_momentum",
    "one_cycle_scale",
    "warmup_cosine_ratio",
    "warmup_decay_gamma",
    "warmup_decay_lr",
    "warmup_gamma",
    "warmup_lr",
]

WARMUP_TYPES = ("log", "linear")


def effective_warmup_steps(warmup_num_steps: int) -> int:
    """DeepSpeed warms up over at least 2 steps (log(1) would divide by zero)."""
    return max(2, warmup_num_steps)


def warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str = "log") -> float:
    """Warmup progress in [0, 1]: ``log(step+1)/log(W)`` or ``step/W``; 1 once ``step >= W``."""
    n = effective_warmup_steps(warmup_num_steps)
    if step >= n:
        return 1.0
    if warmup_type == "log":
        return (1.0 / math.log(n)) * math.log(step + 1)  # DeepSpeed's order of operations, to the last bit
    if warmup_type == "linear":
        return step / n
    raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def warmup_lr(step: int, min_lr: float, max_lr: float, warmup_num_steps: int, warmup_type: str = "log") -> float:
    """WarmupLR: ``min + (max - min) * gamma``; ``min_lr`` before the first step (step < 0)."""
    if step < 0:
        return min_lr
    return min_lr + (max_lr - min_lr) * warmup_gamma(step, warmup_num_steps, warmup_type)


def warmup_decay_gamma(step: int, warmup_num_steps: int, total_num_steps: int, warmup_type: str = "log") -> float:
    """WarmupDecayLR's gamma: warmup as above, then ``(T - step) / (T - W)`` linearly down to 0."""
    n = effective_warmup_steps(warmup_num_steps)
    if step < n:
        return warmup_gamma(step, warmup_num_steps, warmup_type)
    return max(0.0, (total_num_steps - step) / max(1.0, total_num_steps - n))


def warmup_decay_lr(
    step: int,
    min_lr: float,
    max_lr: float,
    warmup_num_steps: int,
    total_num_steps: int,
    warmup_type: str = "log",
) -> float:
    """WarmupDecayLR: ``min + (max - min) * gamma`` — decays to ``min_lr`` (0 by default)."""
    if step < 0:
        return min_lr
    return min_lr + (max_lr - min_lr) * warmup_decay_gamma(step, warmup_num_steps, total_num_steps, warmup_type)


def warmup_cosine_ratio(
    step: int,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> float:
    """WarmupCosineLR's multiplier of the optimizer's base lr.

    Warmup: ``wmin + (1 - wmin) * gamma``. Then cosine from 1 to ``cos_min_ratio`` over
    ``T - W`` steps, progress ``(step - W + 1) / (T - W)`` clamped to 1 so it stays at the floor
    past the end. 0 before the first step (DeepSpeed's value at step -1).
    """
    if step < 0:
        return 0.0
    n = effective_warmup_steps(warmup_num_steps)
    if step < n:
        gamma = warmup_gamma(step, warmup_num_steps, warmup_type)
        return warmup_min_ratio + gamma * (1.0 - warmup_min_ratio)
    progress = min(1.0, (step - n + 1) / max(1, total_num_steps - n))
    cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)


def one_cycle_scale(
    step: int,
    first_step_size: int,
    second_step_size: int,
    first_stair_count: int = 0,
    second_stair_count: int = 0,
) -> float:
    """Position in the 1Cycle triangle, 0 at the edges and 1 at the peak, for batch ``step + 1``.

    DeepSpeed's float arithmetic, operation for operation, so the lrs are bit-identical to its
    (``x / ratio`` can sit an ulp off the exact fraction: 0.4999999999999999 for 2 of 4 steps
    in a 4 + 6 cycle). ``second_step_size`` 0 is a sawtooth: the lr climbs, then restarts.
    A stair count > 0 holds the value flat over ``size / count`` steps of that half; like
    DeepSpeed it is quantised from the integer offset into the cycle, not from the float scale,
    so every stair (the peak included) is reached exactly.
    """
    batch = step + 1
    total = float(first_step_size) + float(second_step_size)
    ratio = first_step_size / total
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    if x <= ratio:
        scale, stairs = x / ratio, first_stair_count
    else:
        scale, stairs = (x - 1) / (ratio - 1), second_stair_count
    if stairs > 0:
        offset = batch % total
        if offset <= first_step_size:
            position = offset * stairs / first_step_size
        else:
            position = (total - offset) * stairs / second_step_size
        scale = math.floor(position) / stairs
    return scale


def one_cycle_lr(
    step: int,
    min_lr: float,
    max_lr: float,
    first_step_size: int,
    second_step_size: int,
    first_stair_count: int = 0,
    second_stair_count: int = 0,
    decay_lr_rate: float = 0.0,
    decay_step_size: int = 0,
) -> float:
    """1Cycle lr: ``min + (max - min) * scale`` within the cycle; after it (when decay is on)
    ``min / (1 + rate * (d / decay_step_size))`` with ``d = step - cycle_len + 1``, else ``min``."""
    total = first_step_size + second_step_size
    if step < total:
        scale = one_cycle_scale(step, first_step_size, second_step_size, first_stair_count, second_stair_count)
        return min_lr + (max_lr - min_lr) * scale
    if decay_step_size == 0 or decay_lr_rate == 0:
        return min_lr
    return min_lr / (1 + decay_lr_rate * ((step - total + 1) / decay_step_size))


def one_cycle_momentum(
    step: int,
    min_mom: float,
    max_mom: float,
    first_step_size: int,
    second_step_size: int,
    first_stair_count: int = 0,
    second_stair_count: int = 0,
    decay_mom_rate: float = 0.0,
    decay_step_size: int = 0,
) -> float:
    """1Cycle momentum, inverse to the lr: ``max - (max - min) * scale`` within the cycle; after
    it (when decay is on) ``max * (1 + rate * (d / decay_step_size))``, else ``max`` (DeepSpeed
    grows it, so a long decay can pass 1)."""
    total = first_step_size + second_step_size
    if step < total:
        scale = one_cycle_scale(step, first_step_size, second_step_size, first_stair_count, second_stair_count)
        return max_mom - (max_mom - min_mom) * scale
    if decay_step_size == 0 or decay_mom_rate == 0:
        return max_mom
    return max_mom * (1 + decay_mom_rate * ((step - total + 1) / decay_step_size))


def lr_range_test_lr(
    step: int, min_lr: float, step_size: int, step_rate: float = 1.0, staircase: bool = False
) -> float:
    """LRRangeTest: ``min * (1 + rate * interval)``, interval ``(step+1)/size`` (floored when
    ``staircase``)."""
    interval = (step + 1) / step_size
    if staircase:
        interval = math.floor(interval)
    return min_lr * (1.0 + step_rate * interval)
