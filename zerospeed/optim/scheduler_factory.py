"""Build the LR scheduler from DeepSpeed's ``scheduler`` config section or a client scheduler.

Names are case-sensitive, as in DeepSpeed: one of ours (``WarmupLR``, ``WarmupDecayLR``,
``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) or any ``torch.optim.lr_scheduler`` class by
its exact name. A client scheduler (instance, or callable(optimizer)) takes precedence over the
config, as in current DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import lr_scheduler as torch_schedulers

from zerospeed.optim._kwargs import check_params, closest_names
from zerospeed.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

__all__ = ["DEEPSPEED_SCHEDULERS", "build_lr_scheduler"]

DEEPSPEED_SCHEDULERS: dict[str, type] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}

_TORCH_BASES = ("LRScheduler", "_LRScheduler")


def build_lr_scheduler(
    sched_type: str | None,
    sched_params: dict[str, Any] | None,
    optimizer: Any,
    client_scheduler: Any | Callable[[Any], Any] | None = None,
) -> Any | None:
    """Return the LR scheduler, or None when neither the config nor the client names one.

    Args:
        sched_type: ``scheduler.type`` from the config, or None.
        sched_params: ``scheduler.params`` from the config, or None.
        optimizer: the optimizer whose param groups the scheduler drives (a wrapper exposing
            ``param_groups`` works for ours; torch's need the inner ``torch.optim.Optimizer``,
            reached through ``.optimizer`` when the wrapper is not one).
        client_scheduler: a scheduler instance, or a callable(optimizer) -> scheduler.
    """
    if client_scheduler is not None:
        if sched_type is not None:
            logger.warning("client LR scheduler given: ignoring scheduler.type %r from the config", sched_type)
        return client_scheduler(optimizer) if callable(client_scheduler) else client_scheduler
    if sched_type is None:
        return None
    cls = _scheduler_class(sched_type)
    params = dict(sched_params or {})
    check_params(params, cls, "scheduler.params")
    target = optimizer if cls in DEEPSPEED_SCHEDULERS.values() else _torch_optimizer(optimizer)
    try:
        scheduler = cls(target, **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"scheduler.params: {sched_type} rejected {params}: {err}") from err
    logger.info("LR scheduler: %s", sched_type)
    return scheduler


def _scheduler_class(name: Any) -> type:
    if not isinstance(name, str):
        raise ConfigError(f"scheduler.type: must be a string, got {type(name).__name__}")
    if name in DEEPSPEED_SCHEDULERS:
        return DEEPSPEED_SCHEDULERS[name]
    cls = getattr(torch_schedulers, name, None)
    if name not in _TORCH_BASES and _is_torch_scheduler(cls):
        return cls
    hint = closest_names(name, [*DEEPSPEED_SCHEDULERS, *_torch_scheduler_names()])
    raise ConfigError(
        f"scheduler.type: unknown scheduler {name!r}"
        + (f"; did you mean {hint}?" if hint else "")
        + f" Valid: {list(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class, by exact (case-sensitive) name."
    )


def _is_torch_scheduler(cls: Any) -> bool:
    bases = (torch_schedulers.LRScheduler, torch_schedulers.ReduceLROnPlateau)
    return isinstance(cls, type) and issubclass(cls, bases)


def _torch_scheduler_names() -> list[str]:
    return sorted(
        n for n in dir(torch_schedulers) if n not in _TORCH_BASES and _is_torch_scheduler(getattr(torch_schedulers, n))
    )


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise ConfigError(
        f"scheduler.type: torch.optim.lr_scheduler classes need a torch.optim.Optimizer, got {type(optimizer).__name__}"
    )
