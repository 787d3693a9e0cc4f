"""fp16 loss scaling as a pure state machine.

The scaler never touches tensors: the engine scales the loss by ``scaler.scale``, checks the
gradients for inf/nan on every rank, agrees on one verdict (an all-reduce of a flag), and calls
``scaler.update(overflow)`` exactly once per optimizer step. Keeping the state machine free of
torch and of ``torch.distributed`` makes its sequences testable with plain booleans.

Semantics follow DeepSpeed's ``DynamicLossScaler.update_scale``:

* ``hysteresis`` is the number of overflows tolerated before the scale drops; each overflow that
  does not drop the scale spends one unit of that budget.
* The budget is refilled after every clean step when ``consecutive_hysteresis`` is true, otherwise
  only when the scale grows.
* The scale grows by ``scale_factor`` after ``scale_window`` consecutive clean steps, counted from
  the last overflow (or from the start).
* The scale never drops below ``min_scale``; an overflow that would lower a scale already at its
  minimum raises :class:`LossScaleUnderflowError` when ``raise_error_at_min_scale`` is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from zerospeed.utils.errors import ConfigError

# Debug level: the engine reports skipped steps itself (once, on rank 0).
logger = logging.getLogger(__name__)

__all__ = [
    "DynamicLossScaler",
    "LossScalePlan",
    "LossScaleUnderflowError",
    "LossScaler",
    "StaticLossScaler",
    "loss_scaler_from_config",
]


class LossScaleUnderflowError(RuntimeError):
    """Raised when an overflow asks for a loss scale below ``min_scale``."""


class LossScaler(Protocol):
    """What the engine relies on; both scalers below satisfy it."""

    scale: float
    dynamic: bool

    def update(self, overflow: bool) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale`` > 0). Overflowed steps are still skipped by the
    engine, but the scale never changes."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ConfigError(f"fp16.loss_scale: must be > 0 for a static scale, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """No-op: a static scale ignores overflows."""

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keeps the configured scale: a static scale is configuration, not state, so a changed
        ``fp16.loss_scale`` takes effect on resume."""

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.scale})"


class DynamicLossScaler:
    """DeepSpeed-compatible dynamic loss scaling (``fp16.loss_scale`` == 0).

    Args:
        init_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        scale_factor: the scale is divided by this on overflow and multiplied by it on growth.
        scale_window: clean steps, counted from the last overflow, before the scale grows.
        min_scale: floor of the scale.
        hysteresis: overflows tolerated before the scale drops (DeepSpeed's ``delayed_shift``).
        consecutive_hysteresis: refill the hysteresis budget after every clean step instead of
            only when the scale grows.
        raise_error_at_min_scale: raise instead of silently staying at ``min_scale``.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, hysteresis)
        self.scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # The mutable state: everything below is what a checkpoint must carry.
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step given the all-rank overflow verdict."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            logger.debug(
                "fp16 overflow: skipping step at loss scale %s; hysteresis left %d",
                self.scale,
                self.cur_hysteresis,
            )
        else:
            self._lower_scale()
        self.last_overflow_iter = self.cur_iter

    def _lower_scale(self) -> None:
        if self.scale == self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleUnderflowError(
                f"loss scale already at its minimum {self.min_scale}: the model produces inf/nan "
                "gradients even unscaled. Lower the learning rate, check the data for bad "
                "samples, or train in bf16 instead of fp16 (or lower fp16.min_loss_scale)."
            )
        new_scale = max(self.scale / self.scale_factor, self.min_scale)
        logger.debug("fp16 overflow: skipping step, loss scale %s -> %s", self.scale, new_scale)
        self.scale = new_scale

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            self.scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": True,
            "scale": self.scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the running state; the configuration (window, factor, ...) stays as built."""
        missing = [k for k in ("scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if k not in state]
        if missing:
            raise ValueError(
                f"DynamicLossScaler.load_state_dict: state lacks {missing} (was it saved by a "
                "static loss scaler? fp16.loss_scale must match the checkpoint's run)"
            )
        self.scale = float(state["scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale}, scale_window={self.scale_window}, "
            f"hysteresis={self.cur_hysteresis}/{self.hysteresis}, min_scale={self.min_scale})"
        )


def _check_dynamic_args(
    init_scale: float, scale_factor: float, scale_window: int, min_scale: float, hysteresis: int
) -> None:
    if not init_scale > 0:
        raise ConfigError(f"fp16.initial_scale_power: initial loss scale must be > 0, got {init_scale}")
    if not scale_factor > 1:
        raise ConfigError(f"loss scale factor must be > 1, got {scale_factor}")
    if not (isinstance(scale_window, int) and scale_window >= 1):
        raise ConfigError(f"fp16.loss_scale_window: must be an integer >= 1, got {scale_window!r}")
    if not min_scale > 0:
        raise ConfigError(f"fp16.min_loss_scale: must be > 0, got {min_scale}")
    if not (isinstance(hysteresis, int) and hysteresis >= 1):
        raise ConfigError(f"fp16.hysteresis: must be an integer >= 1, got {hysteresis!r}")


@dataclass(frozen=True)
class LossScalePlan:
    """How the loss is scaled, resolved once (the engine's plans): a static scale, or the dynamic
    scaler's settings. `build()` makes the scaler (the state machine) it describes."""

    static_scale: float | None = None
    """`fp16.loss_scale` > 0: that fixed scale; None: dynamic scaling with the settings below."""
    init_scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True

    def build(self) -> StaticLossScaler | DynamicLossScaler:
        if self.static_scale is not None:
            return StaticLossScaler(self.static_scale)
        return DynamicLossScaler(
            init_scale=self.init_scale,
            scale_factor=self.scale_factor,
            scale_window=self.scale_window,
            min_scale=self.min_scale,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            raise_error_at_min_scale=self.raise_error_at_min_scale,
        )


def loss_scaler_from_config(fp16: Any) -> StaticLossScaler | DynamicLossScaler:
    """Build the scaler from an object carrying DeepSpeed's fp16 keys as attributes (for callers holding
    such a section; the engine builds its scaler from the `LossScalePlan` its plans resolve).

    ``loss_scale`` 0 selects dynamic scaling starting at ``2 ** initial_scale_power``; any other
    value is a static scale. Missing attributes take DeepSpeed's defaults.
    """
    loss_scale = getattr(fp16, "loss_scale", 0)
    if loss_scale != 0:
        return LossScalePlan(static_scale=loss_scale).build()
    return LossScalePlan(
        init_scale=2.0 ** getattr(fp16, "initial_scale_power", 16),
        scale_window=getattr(fp16, "loss_scale_window", 1000),
        min_scale=getattr(fp16, "min_loss_scale", 1.0),
        hysteresis=getattr(fp16, "hysteresis", 2),
        consecutive_hysteresis=getattr(fp16, "consecutive_hysteresis", False),
    ).build()
