"""Deprecated and alternative key spellings, rewritten on the raw dict before validation.

Deprecated keys warn (``DeprecationWarning`` and a log line) naming their replacement.
Alternative spellings that DeepSpeed accepts without deprecation (its pydantic models take the
Python field name as well as the JSON alias, e.g. ``prefetch_bucket_size`` for
``stage3_prefetch_bucket_size``) are rewritten with an INFO log only. Giving an old spelling
together with its replacement is an error naming both, as in DeepSpeed.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import current_rank, get_logger, should_log

logger = get_logger(__name__)  # Note [rank-0 logging]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_ZERO = "zero_optimization"


@dataclass(frozen=True)
class Rename:
    """``parent.old`` is another spelling of ``parent.new`` (``parent`` empty = top level)."""

    parent: str
    old: str
    new: str
    deprecated: bool


_STAGE3_SHORT_NAMES = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)

RENAMES: tuple[Rename, ...] = (
    Rename("", "bfloat16", "bf16", deprecated=True),
    Rename(
        _ZERO, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", deprecated=True
    ),
    *(Rename(_ZERO, short, f"stage3_{short}", deprecated=False) for short in _STAGE3_SHORT_NAMES),
    Rename("tensor_parallel", "tensor_parallel", "tp", deprecated=False),
    Rename("tensor_parallel", "replace_with_kernel_inject", "kernel_inject", deprecated=False),
)


def _dotted(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _warn(message: str) -> None:
    # Point the warning at the user's call, not at a frame inside this package (the call
    # depth differs between aliases, so a fixed stacklevel would not do).
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _announce(old: str, new: str, deprecated: bool, how: str = "") -> None:
    if deprecated:
        message = f"config key {old} is deprecated; use {new}{how} instead (applied automatically)"
        if should_log([0], current_rank()):  # once per job, like the log line (Note [rank-0 logging])
            _warn(message)
        logger.warning(message)
    else:
        logger.info("config key %s is read as %s", old, new)


def _conflict(old: str, new: str) -> ConfigError:
    return ConfigError(f"{old} and {new} are both given; {old} is another spelling of {new}, so keep only {new}")


def _container(raw: dict[str, Any], parent: str) -> dict[str, Any] | None:
    node = raw.get(parent) if parent else raw
    return node if isinstance(node, dict) else None


def _apply_rename(raw: dict[str, Any], rename: Rename) -> None:
    node = _container(raw, rename.parent)
    if node is None or rename.old not in node:
        return
    old, new = _dotted(rename.parent, rename.old), _dotted(rename.parent, rename.new)
    if rename.new in node:
        raise _conflict(old, new)
    _announce(old, new, rename.deprecated)
    node[rename.new] = node.pop(rename.old)


def _bare_bool_zero(raw: dict[str, Any]) -> None:
    # DeepSpeed's oldest form: "zero_optimization": true means stage 1, false means stage 0.
    value = raw.get(_ZERO)
    if isinstance(value, bool):
        stage = 1 if value else 0
        _announce(f"{_ZERO}: {str(value).lower()}", f'{_ZERO}: {{"stage": {stage}}}', True)
        raw[_ZERO] = {"stage": stage}


def _allgather_size(raw: dict[str, Any]) -> None:
    # Top-level allgather_size fed allgather_bucket_size in the bare-bool form above.
    if "allgather_size" not in raw:
        return
    zero = raw.setdefault(_ZERO, {})
    if not isinstance(zero, dict):
        return
    if "allgather_bucket_size" in zero:
        raise _conflict("allgather_size", f"{_ZERO}.allgather_bucket_size")
    _announce("allgather_size", f"{_ZERO}.allgather_bucket_size", True)
    zero["allgather_bucket_size"] = raw.pop("allgather_size")


def _require_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _cpu_offload_flag(zero: dict[str, Any], old: str, new: str) -> None:
    """``cpu_offload`` / ``cpu_offload_param``: true means ``{new: {"device": "cpu"}}``."""
    if old not in zero:
        return
    old_path, new_path = f"{_ZERO}.{old}", f"{_ZERO}.{new}"
    if new in zero:
        raise _conflict(old_path, new_path)
    enabled = _require_bool(old_path, zero.pop(old))
    _announce(old_path, new_path, True, ' with "device": "cpu"')
    if enabled:
        zero[new] = {"device": "cpu"}


def _cpu_offload_pin_memory(zero: dict[str, Any]) -> None:
    """``cpu_offload_use_pin_memory`` sets ``pin_memory`` of whichever offload sections exist."""
    old = "cpu_offload_use_pin_memory"
    if old not in zero:
        return
    old_path = f"{_ZERO}.{old}"
    pin = _require_bool(old_path, zero.pop(old))
    targets = [name for name in ("offload_optimizer", "offload_param") if isinstance(zero.get(name), dict)]
    for name in targets:
        if "pin_memory" in zero[name]:
            raise _conflict(old_path, f"{_ZERO}.{name}.pin_memory")
    new_paths = (
        " and ".join(f"{_ZERO}.{name}.pin_memory" for name in targets)
        or f"{_ZERO}.offload_optimizer.pin_memory / offload_param.pin_memory"
    )
    _announce(old_path, new_paths, True, "" if targets else " (no offload section is set, so it has no effect)")
    for name in targets:
        zero[name]["pin_memory"] = pin


def _zero_offload_flags(raw: dict[str, Any]) -> None:
    zero = raw.get(_ZERO)
    if not isinstance(zero, dict):
        return
    _cpu_offload_flag(zero, "cpu_offload", "offload_optimizer")
    _cpu_offload_flag(zero, "cpu_offload_param", "offload_param")
    _cpu_offload_pin_memory(zero)


def apply_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``raw`` with deprecated/alternative spellings rewritten to DeepSpeed's keys."""
    out = copy.deepcopy(raw)
    _bare_bool_zero(out)
    _allgather_size(out)
    _zero_offload_flags(out)
    for rename in RENAMES:
        _apply_rename(out, rename)
    return out
