"""The one place ``"auto"`` values are resolved.

Configs written for the transformers Trainer say ``"auto"`` where the Trainer fills in a value
(batch sizes, learning rate, bucket sizes from the hidden size, ...). Here each ``"auto"`` is
replaced by the value supplied in ``known`` (keyed by dotted path) and logged. Batch-size keys
left ``"auto"`` are dropped so batch resolution can derive them; any other unresolved
``"auto"`` is an error. A few keys take the literal string ``"auto"`` as a real DeepSpeed value
(``pipeline.stages``, ZenFlow intervals, AutoEP routing options); those are left alone unless
``known`` supplies a value.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerospeed.config.schema.root import BATCH_KEYS
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

AUTO = "auto"

# Keys whose DeepSpeed value may legitimately be the string "auto".
LITERAL_AUTO_KEYS = frozenset(
    {
        "pipeline.stages",
        "zero_optimization.zenflow.select_strategy",
        "zero_optimization.zenflow.select_interval",
        "zero_optimization.zenflow.update_interval",
        "expert_parallel.top_k",
        "expert_parallel.routed_scaling_factor",
        "expert_parallel.score_func",
        "expert_parallel.score_apply",
        "expert_parallel.combine_impl",
    }
)


@dataclass(frozen=True)
class AutoValue:
    """A value for an ``"auto"`` key together with where it came from (for the log line)."""

    value: Any
    source: str = "supplied"


def _unwrap(entry: Any) -> tuple[Any, str]:
    if isinstance(entry, AutoValue):
        return entry.value, entry.source
    return entry, "supplied"


def _walk_autos(node: Any, path: str) -> list[tuple[str, Any, Any]]:
    """``(dotted path, container, key)`` of every ``"auto"`` value under ``node``.

    Lists appear in paths as ``[i]``. The container and key are kept so the value can be
    replaced without re-parsing the path (keys may themselves contain dots).
    """
    found: list[tuple[str, Any, Any]] = []
    if isinstance(node, dict):
        items = [(f"{path}.{key}" if path else str(key), key, value) for key, value in node.items()]
    elif isinstance(node, list):
        items = [(f"{path}[{index}]", index, value) for index, value in enumerate(node)]
    else:
        return found
    for child_path, key, value in items:
        if isinstance(value, str) and value == AUTO:
            found.append((child_path, node, key))
        else:
            found += _walk_autos(value, child_path)
    return found


def _unresolved_message(path: str) -> str:
    return (
        f'{path} is "auto" but nothing supplies its value here; set a value, '
        "or use the transformers Trainer integration which fills it"
    )


def _fill_absent_batch_keys(out: dict[str, Any], known: Mapping[str, Any]) -> None:
    for key in BATCH_KEYS:
        if key not in out and key in known:
            value, source = _unwrap(known[key])
            out[key] = value
            logger.info("auto: %s = %r (%s; key absent from the config)", key, value, source)


def resolve_auto(raw: dict[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every ``"auto"`` replaced from ``known``.

    ``known`` maps dotted keys (``"optimizer.params.lr"``) to values, optionally wrapped in
    ``AutoValue(value, source)``; each replacement is logged at INFO as
    ``auto: <key> = <value> (<source>)``. Top-level batch-size keys without a known value are
    removed (batch resolution derives them). Any other ``"auto"`` without a value raises
    ``ConfigError`` listing every such key. Top-level batch-size keys that are absent are also
    taken from ``known``: config fragments written for the Trainer omit them entirely.
    """
    out = copy.deepcopy(raw)
    _fill_absent_batch_keys(out, known)
    missing: list[str] = []
    # Paths are collected first and applied afterwards so deleting keys cannot disturb the walk.
    for path, container, key in _walk_autos(out, ""):
        if path in known:
            value, source = _unwrap(known[path])
            container[key] = value
            logger.info("auto: %s = %r (%s)", path, value, source)
        elif path in BATCH_KEYS and container is out:
            del container[key]
            logger.info("auto: %s left to batch-size resolution", path)
        elif path not in LITERAL_AUTO_KEYS:
            missing.append(path)
    if missing:
        raise ConfigError("\n".join(_unresolved_message(path) for path in missing))
    return out


def unresolved_batch_keys(raw: Mapping[str, Any], known: Mapping[str, Any]) -> list[str]:
    """Batch-size keys that are ``"auto"`` in ``raw`` and have no value in ``known``."""
    return [key for key in BATCH_KEYS if raw.get(key) == AUTO and key not in known]


def auto_values_from_hidden_size(hidden_size: int) -> dict[str, int]:
    """Bucket sizes the transformers integration derives from the model's hidden size ``h``.

    ``reduce_bucket_size = h*h``, ``stage3_prefetch_bucket_size = int(0.9*h*h)``,
    ``stage3_param_persistence_threshold = 10*h``.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ConfigError(f"hidden_size must be a positive integer, got {hidden_size!r}")
    square = hidden_size * hidden_size
    return {
        "zero_optimization.reduce_bucket_size": square,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * square),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }
