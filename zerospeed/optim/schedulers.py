"""DeepSpeed's LR schedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Each class is a thin stateful shell around a formula in ``lr_formulas.py``. The only state is
``last_batch_iteration`` (-1 before the first ``step()``), which is all ``state_dict()`` holds,
as in DeepSpeed. API, as DeepSpeed's:

* construction with ``last_batch_iteration=-1`` writes the step -1 lr into the optimizer at once
  (``warmup_min_lr``, ``cycle_min_lr``, ``lr_range_test_min_lr``; 0 for WarmupCosineLR);
  resuming with another value leaves the optimizer untouched until the next ``step()``;
* ``step(last_batch_iteration=None)`` advances by one (or jumps to the given iteration) and
  writes one lr per param group;
* ``get_lr()`` is the lr list for the current iteration, ``get_last_lr()`` what was last written.

Lists: ``warmup_min_lr``, ``warmup_max_lr``, ``cycle_min_lr``, ``cycle_max_lr``,
``cycle_min_mom``, ``cycle_max_mom`` and ``lr_range_test_min_lr`` may be one value per param group.

Where DeepSpeed accepts a value with a warning we do too, with DeepSpeed's result (an unknown
``warmup_type`` warms up as "log"; ``cycle_second_step_size=0`` is a sawtooth). The one place we
differ on purpose: OneCycle keeps each group's ``betas[1]`` where DeepSpeed writes 0.99 (see
docs/migrating_from_deepspeed.md, "Where zerospeed differs on purpose").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerospeed.optim import lr_formulas as F
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

# DeepSpeed's scheduler names (`deepspeed.runtime.lr_schedules`), which accelerate and transformers check types against
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# DeepSpeed's names for the config keys of `scheduler.params` (and the two warmup types), which client code
# uses to build those dicts: each is the key's own spelling, the one these classes take as keyword arguments
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


def _param_groups_owner(optimizer: Any) -> Any:
    """The object whose ``param_groups`` we write: the optimizer itself or, for wrappers that
    expose none, its ``.optimizer``."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch.optim.Optimizer")


def _per_group(value: float | Sequence[float], n_groups: int, key: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(
                f"scheduler.params.{key}: expected {n_groups} values (one per param group), got {len(value)}"
            )
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _check_positive_int(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"scheduler.params.{key}: must be a positive integer, got {value!r}")


def _warmup_type(warmup_type: Any, scheduler: str) -> str:
    """DeepSpeed's fallback: an unknown warmup_type warms up as "log", with a warning."""
    if warmup_type in F.WARMUP_TYPES:
        return warmup_type
    logger.warning(
        "%s: scheduler.params.warmup_type %r is not one of %s; warming up as 'log' (DeepSpeed's "
        "fallback); set it to 'log' or 'linear' to silence this",
        scheduler,
        warmup_type,
        list(F.WARMUP_TYPES),
    )
    return "log"


class _BatchScheduler:
    """Shared shell: holds ``last_batch_iteration`` and writes lrs (and momenta) to the groups."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _param_groups_owner(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        """Called at the end of a subclass ``__init__`` (all parameters are set by then)."""
        if self.last_batch_iteration == -1:
            self._write()

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current ``last_batch_iteration``."""
        raise NotImplementedError

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` of each group at the current iteration, or None when momentum is not cycled."""
        return None

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lrs.

        ``batch_iteration`` is the same argument under the name DeepSpeed's OneCycle and
        LRRangeTest use, so ``engine.step(lr_kwargs=...)`` written for either keeps working.
        """
        if batch_iteration is not None:
            if last_batch_iteration is not None:
                raise TypeError("step(): pass last_batch_iteration or batch_iteration, not both")
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the iteration; the optimizer's lrs change at the next ``step()``."""
        self.last_batch_iteration = state["last_batch_iteration"]

    def _write(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _set_scalar(group, "lr", lr)
        self._last_lr = [float(lr) for lr in lrs]
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas


def _set_scalar(group: dict[str, Any], key: str, value: float) -> None:
    # A tensor lr (capturable / compiled optimizers) must stay the same tensor object.
    if isinstance(group[key], torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


class WarmupLR(_BatchScheduler):
    """Warm the lr from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    ("log": ``min + (max-min) * log(step+1)/log(W)``, "linear": ``... * step/W``), then hold.
    ``warmup_max_lr=None`` takes each group's current lr."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        warmup_type = _warmup_type(warmup_type, type(self).__name__)
        n = len(self.optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = warmup_type
        self._start()

    def _gamma(self) -> float:
        return F.warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from ``warmup_max_lr`` to ``warmup_min_lr`` at
    ``total_num_steps`` (``gamma = (T - step) / (T - W)``, floored at 0)."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_positive_int(total_num_steps, "total_num_steps")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %s < warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        return F.warmup_decay_gamma(
            self.last_batch_iteration, self.warmup_num_steps, self.total_num_steps, self.warmup_type
        )


class WarmupCosineLR(_BatchScheduler):
    """Scale each group's lr (read at construction) by a ratio warming from ``warmup_min_ratio``
    to 1 over ``warmup_num_steps``, then following a cosine down to ``cos_min_ratio`` at
    ``total_num_steps``, and holding there."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int(total_num_steps, "total_num_steps")
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        warmup_type = _warmup_type(warmup_type, "WarmupCosineLR")
        if total_num_steps < warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %s < warmup_num_steps %s", total_num_steps, warmup_num_steps
            )
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The multiplier of the base lrs at the current iteration."""
        return F.warmup_cosine_ratio(
            self.last_batch_iteration,
            self.total_num_steps,
            self.warmup_min_ratio,
            self.warmup_num_steps,
            self.cos_min_ratio,
            self.warmup_type,
        )

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_BatchScheduler):
    """1Cycle: the lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size``, then decays
    (``min / (1 + decay_lr_rate * d / decay_step_size)``) when ``decay_step_size`` > 0.

    With ``cycle_momentum`` the momentum moves inversely between ``cycle_max_mom`` and
    ``cycle_min_mom``, as DeepSpeed: it is ``betas[0]``, so only optimizers with ``betas`` in their
    defaults (the Adam family) cycle it; for others (SGD & co.) it is disabled with a warning.
    ``get_mom()`` is one ``(beta1, beta2)`` per group; construction writes ``cycle_min_mom``.
    Each group keeps its own ``betas[1]`` (DeepSpeed writes 0.99 there: a difference on purpose).
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self._init_cycle(
            cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count
        )
        if decay_step_size < 0:
            raise ConfigError(f"scheduler.params.decay_step_size: must be >= 0, got {decay_step_size}")
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and self._supports_momentum()
        if self.cycle_momentum:
            self.min_moms = _per_group(cycle_min_mom, n, "cycle_min_mom")
            self.max_moms = _per_group(cycle_max_mom, n, "cycle_max_mom")
        self._start()

    def _init_cycle(self, first: int, second: int | None, first_stairs: int, second_stairs: int | None) -> None:
        second = first if second is None else second
        _check_positive_int(first, "cycle_first_step_size")
        if isinstance(second, bool) or not isinstance(second, int) or second < 0:
            raise ConfigError(f"scheduler.params.cycle_second_step_size: must be an integer >= 0, got {second!r}")
        if second == 0:
            logger.warning(
                "OneCycle: cycle_second_step_size is 0: the lr climbs for %d steps and drops back to "
                "cycle_min_lr in one step (a sawtooth), as in DeepSpeed",
                first,
            )
        second_stairs = first_stairs if second_stairs is None else second_stairs
        for key, stairs in (("cycle_first_stair_count", first_stairs), ("cycle_second_stair_count", second_stairs)):
            if isinstance(stairs, bool) or not isinstance(stairs, int) or stairs < 0:
                raise ConfigError(f"scheduler.params.{key}: must be an integer >= 0 (0 = continuous), got {stairs!r}")
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count, self.second_stair_count = first_stairs, second_stairs

    @property
    def total_size(self) -> int:
        """Steps in one cycle, up and down."""
        return self.first_step_size + self.second_step_size

    @property
    def step_ratio(self) -> float:
        """The fraction of the cycle spent climbing (DeepSpeed's attribute): 1.0 for a sawtooth."""
        return self.first_step_size / self.total_size

    def _supports_momentum(self) -> bool:
        # DeepSpeed asks the optimizer's defaults; a wrapper without them answers through its groups.
        defaults = getattr(self.optimizer, "defaults", None)
        has_betas = (
            "betas" in defaults
            if isinstance(defaults, dict)
            else all("betas" in g for g in self.optimizer.param_groups)
        )
        if not has_betas:
            logger.warning(
                "OneCycle: cycle_momentum is disabled: %s has no 'betas' (the momentum OneCycle cycles "
                "is betas[0], as in DeepSpeed); set cycle_momentum: false to silence this",
                type(self.optimizer).__name__,
            )
        return has_betas

    def _start(self) -> None:
        if self.last_batch_iteration != -1:
            return
        self._write()
        if self.cycle_momentum:
            # Note [OneCycle's first momentum]: DeepSpeed writes cycle_min_mom at construction, while
            # its formula at step -1 (scale 0) is cycle_max_mom; the first optimizer step uses the former.
            for group, mom in zip(self.optimizer.param_groups, self.min_moms):
                group["betas"] = (mom, group["betas"][1])

    def _cycle_args(self) -> tuple[int, int, int, int]:
        return self.first_step_size, self.second_step_size, self.first_stair_count, self.second_stair_count

    def get_lr(self) -> list[float]:
        step = self.last_batch_iteration
        return [
            F.one_cycle_lr(step, lo, hi, *self._cycle_args(), self.decay_lr_rate, self.decay_step_size)
            for lo, hi in zip(self.min_lrs, self.max_lrs)
        ]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        step, groups = self.last_batch_iteration, self.optimizer.param_groups
        return [
            (
                F.one_cycle_momentum(step, lo, hi, *self._cycle_args(), self.decay_mom_rate, self.decay_step_size),
                group["betas"][1],
            )
            for lo, hi, group in zip(self.min_moms, self.max_moms, groups)
        ]


class LRRangeTest(_BatchScheduler):
    """LR range test: ``lr = min_lr * (1 + step_rate * (step+1)/step_size)`` (the interval
    floored when ``lr_range_test_staircase``), to find the largest lr that still trains."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.min_lrs = _per_group(lr_range_test_min_lr, len(self.optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        return [
            F.lr_range_test_lr(self.last_batch_iteration, lr, self.step_size, self.step_rate, self.staircase)
            for lr in self.min_lrs
        ]
