"""``parse_config``: the whole path from user input to a checked ``ZeroSpeedConfig``.

load_raw -> aliases -> "auto" -> validation -> API checks -> batch sizes (from the elasticity block when
it is enabled) -> implemented features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerospeed.config.aliases import apply_aliases
from zerospeed.config.auto import resolve_auto, unresolved_batch_keys
from zerospeed.config.batch import resolve_batch_size
from zerospeed.config.elastic import resolve_elastic_batch_size
from zerospeed.config.features import check_implemented
from zerospeed.config.loader import load_raw
from zerospeed.config.schema.root import BATCH_KEYS, ZeroSpeedConfig
from zerospeed.config.validation import validate_config
from zerospeed.utils.errors import ConfigAssertionError, ConfigError


def _check_api_rules(cfg: ZeroSpeedConfig) -> None:
    if cfg.optimizer is not None and "max_grad_norm" in cfg.optimizer.params:
        raise ConfigError("optimizer.params.max_grad_norm is not supported; use the top-level gradient_clipping")
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; choose one precision mode")
    if cfg.gradient_allreduce_op == "sum" and cfg.zero_optimization.stage == 3:
        # DeepSpeed's DeepSpeedConfig._do_error_check refuses the pair too, with the first sentence.
        raise ConfigError(
            "gradient_allreduce_op='sum' is not supported with ZeRO stage 3 (as in DeepSpeed); "
            'set gradient_allreduce_op to "mean" (the default), or use zero_optimization.stage '
            "0, 1 or 2 to sum the gradients"
        )
    for on, what in ((cfg.zero_optimization.zenflow is not None, "ZenFlow"), (cfg.compile.deepcompile, "DeepCompile")):
        if cfg.gradient_allreduce_op == "sum" and on:  # (DeepSpeed's _do_error_check, in this order)
            raise ConfigError(
                f"gradient_allreduce_op='sum' is not supported with {what} (as in DeepSpeed); "
                f'set gradient_allreduce_op to "mean" (the default) or turn {what} off'
            )
    stage = cfg.zero_optimization.stage
    if not cfg.managed_gradient_accumulation and cfg.zero_optimization.overlap_comm and stage < 2:
        # Note [caller-managed accumulation] (runtime/grad_accumulation.py); DeepSpeed's engine asserts it
        raise ConfigAssertionError(
            "managed_gradient_accumulation=false supports ZeRO overlap_comm only with ZeRO stage 2 (or 3), not "
            f"with zero_optimization.overlap_comm=true at ZeRO stage {stage}: stages 0-1 reduce in step(), where "
            "there is no backward to overlap (DeepSpeed refuses it too); set overlap_comm to false or use stage 2"
        )


def _with_batch_sizes(
    cfg: ZeroSpeedConfig, world_size: int, auto_keys: list[str], given_keys: list[str]
) -> ZeroSpeedConfig:
    if cfg.elasticity.enabled:  # the elasticity block owns the batch sizes (config/elastic.py, docs/elasticity.md)
        train, micro, gas = resolve_elastic_batch_size(cfg.elasticity, world_size, given_keys)
    else:
        train, micro, gas = resolve_batch_size(
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
            world_size,
            auto_keys=auto_keys,
        )
    return cfg.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )


def _check_arguments(world_size: Any, known: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer (the data-parallel world size), got {world_size!r}")
    if not isinstance(known, Mapping):
        raise ConfigError(f"known must be a mapping of dotted keys to values, got {type(known).__name__}")


def _parse(config: Any, world_size: int, known: Mapping[str, Any], check_features: bool) -> ZeroSpeedConfig:
    raw = apply_aliases(load_raw(config))
    auto_batch = unresolved_batch_keys(raw, known)
    cfg = validate_config(resolve_auto(raw, known))
    _check_api_rules(cfg)
    cfg = _with_batch_sizes(cfg, world_size, auto_batch, [key for key in BATCH_KEYS if key in raw])
    if check_features:
        check_implemented(cfg)
    return cfg


def parse_config(
    config: Any, *, world_size: int = 1, known: Mapping[str, Any] | None = None, check_features: bool = True
) -> ZeroSpeedConfig:
    """Parse a DeepSpeed config into a validated ``ZeroSpeedConfig``.

    ``config`` is a dict, a path to a JSON file, or base64 JSON (see ``load_raw``).
    ``world_size`` is the data-parallel world size used for batch-size resolution.
    ``known`` supplies values for ``"auto"`` keys by dotted path (see ``resolve_auto``).
    With ``check_features`` (the default) any requested feature zerospeed does not implement
    yet is an error. Every problem is reported as ``ConfigError``; no other exception escapes.
    """
    known = {} if known is None else known
    _check_arguments(world_size, known)
    try:
        return _parse(config, world_size, known, check_features)
    except ConfigError:
        raise
    except Exception as exc:  # a bug here must still surface as ConfigError, but recognisably
        raise ConfigError(
            f"internal error while parsing the config ({type(exc).__name__}: {exc}); please report it"
        ) from exc
