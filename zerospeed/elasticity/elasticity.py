"""DeepSpeed's elasticity API: ``compute_elastic_config``, ``elastic_batch`` (``deepspeed.elasticity.elasticity``).

The plan itself (one global batch size that many GPU counts can train with, versions 0.1 and 0.2, as
functions of integers) lives with the config, in ``zerospeed.config.elastic``: an enabled ``elasticity``
block sets the batch sizes while the config is parsed. This module is DeepSpeed's public surface over it:
the target-version check, the world size from ``$WORLD_SIZE`` where DeepSpeed reads it, and the results
in DeepSpeed's shapes. Its building blocks (``get_candidate_batch_sizes``, ``get_valid_gpus``, ...) are
served under this module's names too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from zerospeed.config.elastic import (  # noqa: F401 (DeepSpeed's module also has the v01/v02 helpers)
    HCN_LIST,
    ElasticBatch,
    _get_compatible_gpus_v01,
    _get_compatible_gpus_v02,
    batch_at_world_size,
    check_version,
    ensure_immutable_elastic_config,
    get_best_candidates,
    get_candidate_batch_sizes,
    get_valid_gpus,
    micro_for_world,
    plan,
    resolve_elastic_batch_size,
    validate_block,
)
from zerospeed.elasticity.config import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)
from zerospeed.elasticity.constants import ELASTICITY, ENABLED, ENABLED_DEFAULT, MINIMUM_DEEPSPEED_VERSION
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]


def _version_tuple(text: str, what: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ElasticityError(f"{what} {text!r} is not a version number such as {MINIMUM_DEEPSPEED_VERSION!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    """True when ``target_deepspeed_version`` has elasticity (>= 0.3.8); otherwise ``ElasticityError``."""
    target = _version_tuple(target_deepspeed_version, "target_deepspeed_version")
    minimum = _version_tuple(MINIMUM_DEEPSPEED_VERSION, "MINIMUM_DEEPSPEED_VERSION")
    pad = max(len(target), len(minimum))
    if target + (0,) * (pad - len(target)) < minimum + (0,) * (pad - len(minimum)):
        raise ElasticityError(
            f"target_deepspeed_version {target_deepspeed_version} has no elasticity: it needs "
            f"DeepSpeed {MINIMUM_DEEPSPEED_VERSION} or newer"
        )
    return True


def _world_size_arg(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ElasticityConfigError(f"world_size must be a non-negative integer (0: not known), got {world_size!r}")
    return world_size


def _current_num_gpus(world_size: int) -> int:
    if world_size:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is not None and env.isnumeric() and int(env) > 0:
        return int(env)
    raise ElasticityConfigError(
        "elasticity version 0.2 needs the current world size to choose a batch size: pass "
        f"world_size to compute_elastic_config or set $WORLD_SIZE (it is {env!r})"
    )


def compute_elastic_config(
    ds_config: dict, target_deepspeed_version: str, world_size: int = 0, return_microbatch: bool = False
):
    """DeepSpeed's elasticity API: the global batch size and the GPU counts it can train at.

    ``ds_config`` is a DeepSpeed config dict with an enabled ``elasticity`` block;
    ``target_deepspeed_version`` the DeepSpeed version the job will run (>= 0.3.8). ``world_size``
    (the data-parallel world size; 0: unknown, version 0.2 then reads ``$WORLD_SIZE``) must be one of
    the valid counts, and then the micro batch for it is returned too. The same config always gives
    the same answer, so a scheduler and every rank agree.

    Returns ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus, micro_batch_size)``
    when ``world_size`` > 0 or ``return_microbatch``. Raises ``ElasticityConfigError`` (no, disabled or
    bad block), ``ElasticityError`` (too old a target version) and ``ElasticityIncompatibleWorldSize``.
    """
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config must be a dict (a DeepSpeed config), got {type(ds_config).__name__}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(
            f"the config has no '{ELASTICITY}' block; add one (with \"enabled\": true, "
            "max_train_batch_size and micro_batch_sizes) to run an elastic job"
        )
    block = validate_block(ds_config[ELASTICITY])
    if not block.enabled:
        raise ElasticityConfigError(f"{ELASTICITY}.enabled is false; set it to true to run an elastic job")
    world_size = _world_size_arg(world_size)
    version = check_version(block)
    _compatible_ds_version_check(target_deepspeed_version)
    batch, valid, v02_micro, _ = plan(block, _current_num_gpus(world_size) if version == 0.2 else world_size)
    logger.info("[elasticity] train batch %d, valid world sizes (GPUs / model-parallel size) %s", batch, valid)
    if world_size > 0:
        return batch, valid, micro_for_world(batch, world_size, valid, block.micro_batch_sizes)
    if not return_microbatch:
        return batch, valid
    if version == 0.1:
        raise ElasticityConfigError(
            "version 0.1 chooses the micro batch for a world size: pass world_size > 0 with return_microbatch"
        )
    if v02_micro is None:
        raise ElasticityIncompatibleWorldSize(
            f"no micro batch in {block.micro_batch_sizes} divides the per-GPU batch "
            f"of train batch {batch} at {_current_num_gpus(0)} GPUs"
        )
    return batch, valid, v02_micro


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """True when ``ds_config`` has an ``elasticity`` block with ``enabled`` true."""
    block = ds_config.get(ELASTICITY) if isinstance(ds_config, Mapping) else None
    return isinstance(block, Mapping) and bool(block.get(ENABLED, ENABLED_DEFAULT))


def elastic_batch(config: ElasticityConfig, dp_world_size: int) -> ElasticBatch:
    """The engine's batch sizes for an enabled block at ``dp_world_size`` data-parallel ranks (Note [elastic
    world size] in ``zerospeed.config.elastic``): the global batch is the same at every valid world size."""
    if not config.enabled:
        raise ElasticityConfigError(f"{ELASTICITY}.enabled is false; elastic batch sizes need an enabled block")
    return batch_at_world_size(config.to_block(), dp_world_size)


__all__ = [
    "HCN_LIST",
    "ElasticBatch",
    "compute_elastic_config",
    "elastic_batch",
    "elasticity_enabled",
    "resolve_elastic_batch_size",
    "ensure_immutable_elastic_config",
    "get_best_candidates",
    "get_candidate_batch_sizes",
    "get_valid_gpus",
]
