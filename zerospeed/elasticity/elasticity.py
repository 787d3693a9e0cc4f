"""DeepSpeed's elasticity: one global batch size that many GPU counts can train with, as functions of integers.

A global batch B splits as ``micro * gradient_accumulation_steps * data_parallel_size``, so a job can move
between GPU counts without changing B (and so without changing convergence) as long as every count it
may get divides B into acceptable micro batches. ``compute_elastic_config`` finds such a B (at most
``max_train_batch_size``) and the GPU counts it supports:

- version 0.1: each micro batch, and their least common multiple, is scaled by the largest highly
  composite number that keeps it within the maximum; of these candidates the one valid at the most GPU
  counts in ``[min_gpus, max_gpus]`` wins (ties: the larger batch, or the smaller with
  ``prefer_larger_batch: false``). A GPU count n is valid when some micro batch m divides B and n
  divides B / m.
- version 0.2 runs 0.1 over nodes (``num_gpus_per_node`` GPUs, ``model_parallel_size`` of them per
  model replica) and scales the result to data-parallel ranks; when the current GPU count is not among
  the valid ones it falls back to the largest (or smallest) multiple of ``micro * current dp size``
  within the maximum, valid at the current size only.

Semantics, names and errors are DeepSpeed's (``deepspeed/elasticity/elasticity.py``), with the
differences in Note [elastic deviations]. Nothing here starts processes or reads the world size from
``torch.distributed``; the world size is an argument (or ``$WORLD_SIZE`` where DeepSpeed reads it).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from zerospeed.config.schema.misc import ElasticityConfig as ElasticityBlock
from zerospeed.config.schema.root import BATCH_KEYS
from zerospeed.elasticity.config import (
    ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
)
from zerospeed.elasticity.constants import (
    DEEPSPEED_ELASTICITY_CONFIG, ELASTICITY, ELASTICITY_VERSIONS, ENABLED, ENABLED_DEFAULT,
    LATEST_ELASTICITY_VERSION, MINIMUM_DEEPSPEED_VERSION,
)
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

# The 38 smallest highly composite numbers (OEIS A002182): enough for batch sizes up to 720K.
HCN_LIST = [
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
]

# Note [elastic deviations]: where DeepSpeed's code crashes or returns a meaningless value, this one
# raises an ElasticityError instead; every documented result is the same.
# - A base (micro batch or their LCM) above max_train_batch_size is not a candidate: DeepSpeed before
#   #8237 offered the LCM unscaled and so could return a batch above the maximum.
# - Version 0.2's fallback computes in exact fractions (DeepSpeed: floats) and never returns batch 0:
#   with prefer_larger_batch false it takes the smallest *positive* candidate, and when even one micro
#   batch per data-parallel rank exceeds the maximum it raises ElasticityIncompatibleWorldSize.
# - A version other than 0.1 / 0.2, an empty micro-batch list, return_microbatch at version 0.1 without
#   a world size, and (version 0.1) no candidate valid at any GPU count are ElasticityErrors (DeepSpeed:
#   NotImplementedError, ValueError from min([]), ZeroDivisionError, a TypeError on a None list);
#   version 0.2 then takes its fallback (DeepSpeed: the same TypeError).


def _largest_hcn_at_most(value: int) -> int:
    return max(h for h in HCN_LIST if h <= value)


def get_candidate_batch_sizes(base_list: Iterable[int], max_acceptable_batch_size: int) -> list[int]:
    """Each base scaled by the largest highly composite number keeping it <= the maximum (sorted, unique)."""
    top = max_acceptable_batch_size
    return sorted({base * _largest_hcn_at_most(top // base) for base in base_list if base <= top})


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def get_valid_gpus(batch_size: int, micro_batches: Iterable[int], min_valid_gpus: int,
                   max_valid_gpus: int) -> list[int]:
    """GPU counts n in [min, max] that train ``batch_size``: some micro batch m divides it and n divides it / m."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch_size % micro == 0:
            valid.update(d for d in _divisors(batch_size // micro) if min_valid_gpus <= d <= max_valid_gpus)
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes: Iterable[int], micro_batches: Sequence[int], min_gpus: int,
                        max_gpus: int, prefer_larger: bool) -> tuple[int, list[int]]:
    """The candidate valid at the most GPU counts (ties: the larger, or with ``prefer_larger`` false the
    smaller batch) and its valid counts. The contest starts from (the smallest micro batch, no counts), so
    with no candidate valid anywhere the tie rule picks between those."""
    best_batch, best_valid = int(min(micro_batches)), []
    for batch in sorted(candidate_batch_sizes):
        valid = get_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        tie_wins = batch > best_batch if prefer_larger else batch < best_batch
        if len(valid) > len(best_valid) or (len(valid) == len(best_valid) and tie_wins):
            best_batch, best_valid = batch, valid
    return best_batch, best_valid


def _check_micro_batches(micro_batches: Sequence[int], maximum: int, what: str) -> None:
    if not micro_batches:
        raise ElasticityConfigError(f"{ELASTICITY}.micro_batch_sizes is empty; list at least one micro batch")
    too_big = [m for m in micro_batches if m > maximum]
    if too_big:
        raise ElasticityConfigError(f"{ELASTICITY}.micro_batch_sizes {too_big} exceed {what} {maximum}: every micro "
                                    "batch must fit in one global batch; raise max_train_batch_size or drop them")


def _get_compatible_gpus_v01(micro_batches: Sequence[int], max_acceptable_batch_size: int, min_gpus: int | None = None,
                             max_gpus: int | None = None, prefer_larger: bool = True) -> tuple[int, list[int]]:
    """Version 0.1: ``(batch size, valid GPU counts)``; a GPU bound of 0 or None means 1 / as many as fit."""
    _check_micro_batches(micro_batches, max_acceptable_batch_size, "max_train_batch_size")
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates = get_candidate_batch_sizes(bases, max_acceptable_batch_size)
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _microbatch_v02(batch: int, current_num_gpus: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
    """DeepSpeed's v0.2 pick: a micro batch dividing ``batch // current_num_gpus`` (the largest, or the
    first listed with ``prefer_larger`` false); None if none does."""
    fits = [m for m in micro_batches if batch // current_num_gpus % m == 0]
    if not fits:
        return None
    return max(fits) if prefer_larger else fits[0]


def _get_compatible_gpus_v02(micro_batches: Sequence[int], max_acceptable_batch_size: int, current_num_gpus: int,
                             min_gpus: int | None = None, max_gpus: int | None = None, prefer_larger: bool = True,
                             num_gpus_per_node: int = 1,
                             model_parallel_size: int = 1) -> tuple[int, list[int], int | None]:
    """Version 0.2: ``(batch size, valid data-parallel sizes, micro batch)`` at ``current_num_gpus`` GPUs."""
    batch, valid, micro, _ = _plan_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus,
                                       max_gpus, prefer_larger, num_gpus_per_node, model_parallel_size)
    return batch, valid, micro


def _plan_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus, max_gpus, prefer_larger,
              num_gpus_per_node, model_parallel_size) -> tuple[int, list[int], int | None, bool]:
    """``_get_compatible_gpus_v02`` and whether it fell back to a batch for the current size only."""
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"elasticity version 0.2 needs {ELASTICITY}.num_gpus_per_node ({num_gpus_per_node}) "
                              f"to be divisible by {ELASTICITY}.model_parallel_size ({model_parallel_size}): a model "
                              "replica may not span nodes")
    dp_per_node = num_gpus_per_node // model_parallel_size
    per_node_max = max_acceptable_batch_size // dp_per_node
    _check_micro_batches(micro_batches, per_node_max,
                         "max_train_batch_size / (num_gpus_per_node / model_parallel_size) =")
    node_batch, valid_nodes = _get_compatible_gpus_v01(
        micro_batches, per_node_max, (min_gpus or 1) // num_gpus_per_node,
        (max_gpus or 0) // num_gpus_per_node, prefer_larger=prefer_larger)
    batch = node_batch * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, _microbatch_v02(batch, current_num_gpus, micro_batches, prefer_larger), False
    # Not a planned size: the best multiple of (micro x current dp size) within the maximum, valid here only.
    current_dp = Fraction(current_num_gpus, num_gpus_per_node) * dp_per_node
    fallback = [math.floor(max_acceptable_batch_size / (m * current_dp)) * m * current_dp for m in micro_batches]
    positive = [c for c in fallback if c > 0]
    if not positive:
        raise ElasticityIncompatibleWorldSize(
            f"at {current_num_gpus} GPUs ({current_dp} data-parallel ranks) even the smallest micro batch "
            f"{min(micro_batches)} per rank exceeds {ELASTICITY}.max_train_batch_size {max_acceptable_batch_size}; "
            "run on fewer GPUs or raise max_train_batch_size")
    batch = int(max(positive) if prefer_larger else min(positive))
    return batch, [int(current_dp)], _microbatch_v02(batch, current_num_gpus, micro_batches, prefer_larger), True


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
        raise ElasticityError(f"target_deepspeed_version {target_deepspeed_version} has no elasticity: it needs "
                              f"DeepSpeed {MINIMUM_DEEPSPEED_VERSION} or newer")
    return True


def _check_version(config: ElasticityConfig) -> float:
    version = float(config.version)
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"{ELASTICITY}.version {config.version} does not support model parallelism "
                                    f"({ELASTICITY}.model_parallel_size {config.model_parallel_size}); use version 0.2")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"{ELASTICITY}.version {config.version} is newer than the newest elasticity "
                                    f"version, {LATEST_ELASTICITY_VERSION}; use 0.1 or 0.2")
    if version not in ELASTICITY_VERSIONS:
        raise ElasticityConfigError(f"{ELASTICITY}.version {config.version} is not an elasticity version; "
                                    "use 0.1 or 0.2")
    return version


def _plan(config: ElasticityConfig, current_num_gpus: int) -> tuple[int, list[int], int | None, bool]:
    """``(batch, valid world sizes, v0.2's micro batch or None, v0.2 fell back)`` for an enabled config."""
    if _check_version(config) == 0.1:
        batch, valid = _get_compatible_gpus_v01(config.micro_batches, config.max_acceptable_batch_size,
                                                config.min_gpus, config.max_gpus, config.prefer_larger_batch_size)
        return int(batch), valid, None, False
    return _plan_v02(config.micro_batches, config.max_acceptable_batch_size, current_num_gpus, config.min_gpus,
                     config.max_gpus, config.prefer_larger_batch_size, config.num_gpus_per_node,
                     config.model_parallel_size)


def _micro_for_world(batch: int, world_size: int, valid: list[int], micro_batches: Iterable[int]) -> int:
    """The largest micro batch dividing ``batch / world_size``, or ElasticityIncompatibleWorldSize."""
    if world_size not in valid:
        why = valid if valid else "none: no batch size within max_train_batch_size suits any GPU count in " \
                                  "[min_gpus, max_gpus]"
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not valid for the elasticity block (train batch {batch}); valid world "
            f"sizes: {why}; run at one of them, or change {ELASTICITY}.max_train_batch_size / micro_batch_sizes / "
            "min_gpus / max_gpus")
    return max(m for m in set(micro_batches) if batch // world_size % m == 0)


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
    raise ElasticityConfigError("elasticity version 0.2 needs the current world size to choose a batch size: pass "
                                f"world_size to compute_elastic_config or set $WORLD_SIZE (it is {env!r})")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
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
        raise ElasticityConfigError(f"the config has no '{ELASTICITY}' block; add one (with \"enabled\": true, "
                                    "max_train_batch_size and micro_batch_sizes) to run an elastic job")
    config = ElasticityConfig(ds_config[ELASTICITY])
    if not config.enabled:
        raise ElasticityConfigError(f"{ELASTICITY}.enabled is false; set it to true to run an elastic job")
    world_size = _world_size_arg(world_size)
    version = _check_version(config)
    _compatible_ds_version_check(target_deepspeed_version)
    batch, valid, v02_micro, _ = _plan(config, _current_num_gpus(world_size) if version == 0.2 else world_size)
    logger.info("[elasticity] train batch %d, valid world sizes (GPUs / model-parallel size) %s", batch, valid)
    if world_size > 0:
        return batch, valid, _micro_for_world(batch, world_size, valid, config.micro_batches)
    if not return_microbatch:
        return batch, valid
    if version == 0.1:
        raise ElasticityConfigError("version 0.1 chooses the micro batch for a world size: pass world_size > 0 "
                                    "with return_microbatch")
    if v02_micro is None:
        raise ElasticityIncompatibleWorldSize(f"no micro batch in {config.micro_batches} divides the per-GPU batch "
                                              f"of train batch {batch} at {_current_num_gpus(0)} GPUs")
    return batch, valid, v02_micro


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """True when ``ds_config`` has an ``elasticity`` block with ``enabled`` true."""
    block = ds_config.get(ELASTICITY) if isinstance(ds_config, Mapping) else None
    return isinstance(block, Mapping) and bool(block.get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Check that the elastic config the resource scheduler planned with (``$DEEPSPEED_ELASTICITY_CONFIG``,
    JSON: the elasticity block, or a whole config holding one) matches the one this job runs with."""
    text = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if text is None:  # DeepSpeed warns; under torch's elastic agent there is no such scheduler, so: info
        logger.info("[elasticity] $%s is not set: no resource scheduler's plan to check this elastic config "
                    "against", DEEPSPEED_ELASTICITY_CONFIG)
        return
    try:
        scheduled = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ElasticityConfigError(f"${DEEPSPEED_ELASTICITY_CONFIG} is not JSON ({exc})") from None
    if isinstance(scheduled, dict) and isinstance(scheduled.get(ELASTICITY), dict):
        scheduled = scheduled[ELASTICITY]
    planned, running = ElasticityConfig(scheduled), ElasticityConfig(runtime_elastic_config_dict)
    for key, attr in (("max_train_batch_size", "max_acceptable_batch_size"), ("micro_batch_sizes", "micro_batches"),
                      ("version", "version")):
        if getattr(planned, attr) != getattr(running, attr):
            raise ElasticityConfigError(
                f"{ELASTICITY}.{key} is {getattr(running, attr)} in this job's config but the resource scheduler "
                f"planned with {getattr(planned, attr)} (${DEEPSPEED_ELASTICITY_CONFIG}); give both the same block")


@dataclass(frozen=True)
class ElasticBatch:
    """The batch sizes an elastic job trains with at one data-parallel world size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]
    fallback: bool = False  # version 0.2 off its plan: this batch suits the current size only


def elastic_batch(config: ElasticityConfig, dp_world_size: int) -> ElasticBatch:
    """The engine's batch sizes for an enabled block at ``dp_world_size`` data-parallel ranks.

    Note [elastic world size]: DeepSpeed's runtime passes its data-parallel world size where version 0.2
    expects the GPU count (it divides by model_parallel_size again); the two agree when
    model_parallel_size is 1, the case DeepSpeed tests. Here version 0.2 plans at
    ``dp_world_size * model_parallel_size`` GPUs, what a scheduler passes, so the data-parallel size is
    checked against the data-parallel sizes the plan lists. The micro batch is the largest that divides
    the per-rank batch, and the accumulation steps make up the rest: the global batch is the same at
    every valid world size.
    """
    if not config.enabled:
        raise ElasticityConfigError(f"{ELASTICITY}.enabled is false; elastic batch sizes need an enabled block")
    batch, valid, _, fallback = _plan(config, dp_world_size * config.model_parallel_size)
    micro = _micro_for_world(batch, dp_world_size, valid, config.micro_batches)
    return ElasticBatch(batch, micro, batch // (micro * dp_world_size), tuple(valid), fallback)


def resolve_elastic_batch_size(block: ElasticityBlock, world_size: int, given_keys: Iterable[str] = ()) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)`` for an enabled ``elasticity``
    block (``ZeroSpeedConfig.elasticity``) at ``world_size`` data-parallel ranks: DeepSpeed's runtime rule.

    ``given_keys`` are the batch keys the config itself sets. Elasticity owns the batch sizes, so they are
    an ``ElasticityConfigError`` unless ``ignore_non_elastic_batch_info`` is true (then they are
    overridden, with a warning naming each).
    """
    config = ElasticityConfig.from_block(block)
    given = [key for key in BATCH_KEYS if key in set(given_keys)]
    if given and not config.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"{', '.join(given)} set outside the {ELASTICITY} block: an enabled {ELASTICITY} block sets the batch "
            f"sizes itself at every world size, so these would not be used; remove them, or set "
            f"{ELASTICITY}.ignore_non_elastic_batch_info: true to have them ignored")
    ensure_immutable_elastic_config(block.model_dump(include=block.model_fields_set))
    plan = elastic_batch(config, world_size)
    if plan.fallback:
        logger.warning("[elasticity] %d data-parallel ranks is not a size the elasticity block plans for, so version "
                       "0.2 trains with train_batch_size %d here, which suits this size only: the global batch "
                       "differs from that at the planned sizes", world_size, plan.train_batch_size)
    for key, value in zip(BATCH_KEYS, (plan.train_batch_size, plan.micro_batch_size,
                                       plan.gradient_accumulation_steps)):
        if key in given:
            logger.warning("[elasticity] overriding %s from the config with %d", key, value)
    logger.info("[elasticity] train_batch_size %d = micro batch %d x gradient_accumulation_steps %d x %d "
                "data-parallel ranks; valid data-parallel sizes %s", plan.train_batch_size, plan.micro_batch_size,
                plan.gradient_accumulation_steps, world_size, list(plan.valid_world_sizes))
    return plan.train_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps


__all__ = [
    "HCN_LIST", "ElasticBatch", "compute_elastic_config", "elastic_batch", "elasticity_enabled",
    "resolve_elastic_batch_size",
    "ensure_immutable_elastic_config", "get_best_candidates", "get_candidate_batch_sizes", "get_valid_gpus",
]
