"""``torch_autocast``: the engine runs the model's forward under `torch.autocast` (DeepSpeed's path).

The parameters, their gradients, the optimizer and its states stay fp32; only the operations autocast
lists run in the lower dtype. Two things follow the config beyond the forward itself:

- Note [autocast gradient communication]: the gradients of the parameters owned directly by a
  "lower-precision-safe" module (DeepSpeed's default list: Linear and Conv1d/2d/3d; the config's
  `lower_precision_safe_modules` names others as "package.Class") are reduced across ranks in the
  autocast dtype, every other gradient in `communication_data_type` (fp32 by default). Under autocast a
  safe module's weight gradient is computed in the low dtype and is exactly representable in it, so the
  cast before the collective loses nothing per rank; the sum itself is rounded to the low dtype, which
  halves the bytes. The strategies lay their gradient buffers out so that each buffer holds one kind
  (`kinds` in `zero/partition.build_layouts`); a buffer that still mixes kinds (a stage-3 unit of a
  module with safe and unsafe parameters) is reduced in the higher precision.
- fp16 autocast needs loss scaling (fp32 weights, fp16 activations and activation gradients): the
  engine's dynamic loss scaler follows `torch.amp.GradScaler`'s rule and defaults (start at 2**16,
  halve on an overflow and skip the step, double after 2000 clean steps), which DeepSpeed uses there.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from zerospeed.precision.loss_scaler import DynamicLossScaler, LossScalePlan
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
"""DeepSpeed's default lower-precision-safe module classes."""

_warned_outer_autocast = False


def get_default_autocast_lower_precision_modules() -> list[str]:
    """DeepSpeed's default list as the config spells it ("torch.nn.modules.linear.Linear", ...)."""
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The dtype `torch_autocast.dtype` names ("bf16" / "fp16"); None for None (autocast off)."""
    return None if name is None else {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def safe_module_classes(names: list[str] | None) -> list[type]:
    """The classes `torch_autocast.lower_precision_safe_modules` names (None: DeepSpeed's default list)."""
    if names is None:
        return list(LOWER_PRECISION_SAFE_MODULES)
    classes = []
    for i, name in enumerate(names):
        package, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), cls_name) if package else None
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules[{i}] = {name!r}: cannot import it "
                f"({e}); give a module class as 'package.module.Class', e.g. 'torch.nn.Linear'"
            ) from e
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules[{i}] = {name!r} is not a torch.nn.Module "
                "class; give a module class as 'package.module.Class', e.g. 'torch.nn.Linear'"
            )
        classes.append(cls)
    return classes


def param_comm_dtypes(
    module: torch.nn.Module, dtype: torch.dtype | None, safe_modules: list[str] | None = None
) -> dict[int, torch.dtype]:
    """id(parameter) -> `dtype` (the autocast dtype), for every parameter a safe module owns directly (Note
    [autocast gradient communication]); `safe_modules`: `torch_autocast.lower_precision_safe_modules`
    (None: DeepSpeed's default list). Empty when `dtype` is None (autocast off). Exact classes, as in
    DeepSpeed."""
    if dtype is None:
        return {}
    classes = tuple(safe_module_classes(safe_modules))
    return {id(p): dtype for m in module.modules() if type(m) in classes for p in m.parameters(recurse=False)}


def check_autocast_settings(module: torch.nn.Module, *, quantized_weights: bool = False) -> None:
    """DeepSpeed's conditions for `torch_autocast` beyond the precision keys (`PrecisionPolicy.resolve`
    checks those): no ZeRO++ quantized weights, fp32 parameters."""
    if quantized_weights:
        raise ConfigError(
            "torch_autocast.enabled=true and zero_optimization.zero_quantized_weights=true cannot "
            "be combined (as in DeepSpeed); turn one off"
        )
    low = [n for n, p in module.named_parameters() if p.dtype != torch.float32]
    if low:
        raise ConfigError(
            f"torch_autocast.enabled=true needs float32 parameters; {low[0]} is "
            f"{module.get_parameter(low[0]).dtype} ({len(low)} such): build the model in fp32 "
            "(autocast casts inside the forward)"
        )


AUTOCAST_LOSS_SCALE = LossScalePlan(
    init_scale=2.0**16,
    scale_factor=2.0,
    scale_window=2000,
    min_scale=2.0**-24,
    hysteresis=1,
    raise_error_at_min_scale=False,
)
"""fp16 autocast's loss scale: `torch.amp.GradScaler`'s rule and defaults (no hysteresis, no floor)."""


def autocast_loss_scaler() -> DynamicLossScaler:
    """fp16 autocast's loss scaler (`AUTOCAST_LOSS_SCALE`)."""
    return AUTOCAST_LOSS_SCALE.build()


@contextlib.contextmanager
def forward_autocast(device_type: str, dtype: torch.dtype | None):
    """The engine's forward context: `torch.autocast` in `dtype` when `torch_autocast` is on (`dtype` not None).

    As in DeepSpeed, the engine's setting wins over an autocast the caller opened around it: with
    `torch_autocast` off, an outer autocast is switched off inside the engine's forward (the engine's
    precision is its fp16 / bf16 section), with a one-time warning."""
    global _warned_outer_autocast
    outer = torch.is_autocast_enabled(device_type)
    if outer and not _warned_outer_autocast:
        _warned_outer_autocast = True
        logger.warning(
            "torch.autocast is open around the engine's forward; the engine follows its own "
            "torch_autocast section instead (%s)",
            "on" if dtype is not None else "off",
        )
    if dtype is not None:
        with torch.autocast(device_type=device_type, dtype=dtype, enabled=True):
            yield
    elif outer:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield


def autocast_if_enabled(engine):
    """DeepSpeed's name: `forward_autocast` for `engine`'s device and precision policy."""
    return forward_autocast(engine.accelerator.device_name(), engine.precision.autocast_dtype)
