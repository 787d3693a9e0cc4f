"""The elastic batch plan: one global batch size that many GPU counts can train with, as functions of integers.

A global batch B splits as ``micro * gradient_accumulation_steps * data_parallel_size``, so a job can move
between GPU counts without changing B (and so without changing convergence) as long as every count it
may get divides B into acceptable micro batches. The plan finds such a B (at most ``max_train_batch_size``)
and the GPU counts it supports:

- version 0.1: each micro batch, and their least common multiple, is scaled by the largest highly
  composite number that keeps it within the maximum; of these candidates the one valid at the most GPU
  counts in ``[min_gpus, max_gpus]`` wins (ties: the larger batch, or the smaller with
  ``prefer_larger_batch: false``). A GPU count n is valid when some micro batch m divides B and n
  divides B / m.
- version 0.2 runs 0.1 over nodes (``num_gpus_per_node`` GPUs, ``model_parallel_size`` of them per
  model replica) and scales the result to data-parallel ranks; when the current GPU count is not among
  the valid ones it falls back to the largest (or smallest) multiple of ``micro * current dp size``
  within the maximum, valid at the current size only.

The config owns this because an enabled ``elasticity`` block sets the batch sizes (``parse_config``, through
``resolve_elastic_batch_size``). ``zerospeed.elasticity`` is DeepSpeed's public API over it
(``compute_elastic_config``, ``ElasticityConfig`` under DeepSpeed's attribute names, the constants); the
plan works on the schema's typed block. Semantics, names and errors are DeepSpeed's
(``deepspeed/elasticity/elasticity.py``), with the differences in Note [elastic deviations]. Nothing here
starts processes or reads the world size from ``torch.distributed``: the world size is an argument.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from zerospeed.config.schema.misc import ElasticityConfig as ElasticityBlock
from zerospeed.config.schema.root import BATCH_KEYS
from zerospeed.config.validation import validate_config  # the root schema names keys as elasticity.<key>
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

ELASTICITY = "elasticity"  # the block's key in a DeepSpeed config

# The algorithm versions there are; the newest is the default.
ELASTICITY_VERSIONS = (0.1, 0.2)
LATEST_ELASTICITY_VERSION = max(ELASTICITY_VERSIONS)

# A resource scheduler puts the elastic config it planned with here (JSON), so the runtime can check
# that it uses the same one (``ensure_immutable_elastic_config``).
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"

# The 38 smallest highly composite numbers (OEIS A002182): enough for batch sizes up to 720K.
HCN_LIST = [
    1,
    2,
    4,
    6,
    12,
    24,
    36,
    48,
    60,
    120,
    180,
    240,
    360,
    720,
    840,
    1260,
    1680,
    2520,
    5040,
    7560,
    10080,
    15120,
    20160,
    25200,
    27720,
    45360,
    50400,
    55440,
    83160,
    110880,
    166320,
    221760,
    277200,
    332640,
    498960,
    554400,
    665280,
    720720,
]


# Note [elasticity errors are config errors]: DeepSpeed's three exception types keep their names and their
# hierarchy (both others derive from ``ElasticityError``), and ``ElasticityError`` derives from zerospeed's
# ``ConfigError`` (itself a ``ValueError``): ``parse_config`` promises that every problem is a
# ``ConfigError``, and DeepSpeed code that catches ``ElasticityError`` (or the ``ValueError`` DeepSpeed
# raises for a micro batch above the maximum) still catches ours.


class ElasticityError(ConfigError):
    """Base of every elasticity error (Note [elasticity errors are config errors])."""


class ElasticityConfigError(ElasticityError):
    """The elasticity block is missing, disabled or inconsistent."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The current world size is not one the elastic config supports."""


# --- the block ----------------------------------------------------------------------------------


def check_block(block: ElasticityBlock) -> None:
    """Raise ``ElasticityConfigError`` for a typed block whose keys do not make sense together.

    Note [elastic block checks]: the schema types each key (positive GPU counts, a list of integers);
    these are DeepSpeed's checks across keys: when enabled, the two batch keys must be written out
    (their defaults are never used silently), every micro batch must be positive, and min_gpus may not
    exceed max_gpus. The version and model-parallel checks belong to ``check_version``.
    """
    if block.enabled:
        missing = [k for k in ("max_train_batch_size", "micro_batch_sizes") if k not in block.model_fields_set]
        if missing:
            raise ElasticityConfigError(
                f"{' and '.join(f'{ELASTICITY}.{k}' for k in missing)} missing: an enabled elasticity block must "
                "give the largest acceptable global batch (max_train_batch_size) and the acceptable micro "
                'batches (micro_batch_sizes), e.g. "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]'
            )
    micro = block.micro_batch_sizes
    if not micro or any(m < 1 for m in micro):
        raise ElasticityConfigError(
            f"{ELASTICITY}.micro_batch_sizes must list positive integers (at least one), got {micro}"
        )
    if block.min_gpus > block.max_gpus:
        raise ElasticityConfigError(
            f"{ELASTICITY}.min_gpus {block.min_gpus} is greater than {ELASTICITY}.max_gpus "
            f"{block.max_gpus}; make min_gpus <= max_gpus"
        )


def validate_block(param_dict: Any) -> ElasticityBlock:
    """Type and check a raw ``elasticity`` block; any problem is an ``ElasticityConfigError`` naming the key."""
    if not isinstance(param_dict, Mapping):
        raise ElasticityConfigError(f"{ELASTICITY} must be an object ({{...}}), got {type(param_dict).__name__}")
    try:
        block = validate_config({ELASTICITY: dict(param_dict)}).elasticity
    except ConfigError as exc:
        raise ElasticityConfigError(str(exc)) from None
    check_block(block)
    return block


def check_version(block: ElasticityBlock) -> float:
    """The block's algorithm version (0.1 or 0.2), or ``ElasticityConfigError``."""
    version = float(block.version)
    if block.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(
            f"{ELASTICITY}.version {block.version} does not support model parallelism "
            f"({ELASTICITY}.model_parallel_size {block.model_parallel_size}); use version 0.2"
        )
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(
            f"{ELASTICITY}.version {block.version} is newer than the newest elasticity "
            f"version, {LATEST_ELASTICITY_VERSION}; use 0.1 or 0.2"
        )
    if version not in ELASTICITY_VERSIONS:
        raise ElasticityConfigError(
            f"{ELASTICITY}.version {block.version} is not an elasticity version; use 0.1 or 0.2"
        )
    return version


# --- the plan, pure -------------------------------------------------------------------------------

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


def get_valid_gpus(
    batch_size: int, micro_batches: Iterable[int], min_valid_gpus: int, max_valid_gpus: int
) -> list[int]:
    """GPU counts n in [min, max] that train ``batch_size``: some micro batch m divides it and n divides it / m."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch_size % micro == 0:
            valid.update(d for d in _divisors(batch_size // micro) if min_valid_gpus <= d <= max_valid_gpus)
    return sorted(valid)


def get_best_candidates(
    candidate_batch_sizes: Iterable[int],
    micro_batches: Sequence[int],
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool,
) -> tuple[int, list[int]]:
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
        raise ElasticityConfigError(
            f"{ELASTICITY}.micro_batch_sizes {too_big} exceed {what} {maximum}: every micro "
            "batch must fit in one global batch; raise max_train_batch_size or drop them"
        )


def _get_compatible_gpus_v01(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
) -> tuple[int, list[int]]:
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


def _get_compatible_gpus_v02(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    current_num_gpus: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Version 0.2: ``(batch size, valid data-parallel sizes, micro batch)`` at ``current_num_gpus`` GPUs."""
    batch, valid, micro, _ = _plan_v02(
        micro_batches,
        max_acceptable_batch_size,
        current_num_gpus,
        min_gpus,
        max_gpus,
        prefer_larger,
        num_gpus_per_node,
        model_parallel_size,
    )
    return batch, valid, micro


def _plan_v02(
    micro_batches,
    max_acceptable_batch_size,
    current_num_gpus,
    min_gpus,
    max_gpus,
    prefer_larger,
    num_gpus_per_node,
    model_parallel_size,
) -> tuple[int, list[int], int | None, bool]:
    """``_get_compatible_gpus_v02`` and whether it fell back to a batch for the current size only."""
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(
            f"elasticity version 0.2 needs {ELASTICITY}.num_gpus_per_node ({num_gpus_per_node}) "
            f"to be divisible by {ELASTICITY}.model_parallel_size ({model_parallel_size}): a model "
            "replica may not span nodes"
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    per_node_max = max_acceptable_batch_size // dp_per_node
    _check_micro_batches(
        micro_batches, per_node_max, "max_train_batch_size / (num_gpus_per_node / model_parallel_size) ="
    )
    node_batch, valid_nodes = _get_compatible_gpus_v01(
        micro_batches,
        per_node_max,
        (min_gpus or 1) // num_gpus_per_node,
        (max_gpus or 0) // num_gpus_per_node,
        prefer_larger=prefer_larger,
    )
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
            "run on fewer GPUs or raise max_train_batch_size"
        )
    batch = int(max(positive) if prefer_larger else min(positive))
    return batch, [int(current_dp)], _microbatch_v02(batch, current_num_gpus, micro_batches, prefer_larger), True


def plan(block: ElasticityBlock, current_num_gpus: int) -> tuple[int, list[int], int | None, bool]:
    """``(batch, valid world sizes, v0.2's micro batch or None, v0.2 fell back)`` for a block's settings."""
    micro, top = list(block.micro_batch_sizes), block.max_train_batch_size
    if check_version(block) == 0.1:
        batch, valid = _get_compatible_gpus_v01(micro, top, block.min_gpus, block.max_gpus, block.prefer_larger_batch)
        return int(batch), valid, None, False
    return _plan_v02(
        micro,
        top,
        current_num_gpus,
        block.min_gpus,
        block.max_gpus,
        block.prefer_larger_batch,
        block.num_gpus_per_node,
        block.model_parallel_size,
    )


def micro_for_world(batch: int, world_size: int, valid: list[int], micro_batches: Iterable[int]) -> int:
    """The largest micro batch dividing ``batch / world_size``, or ElasticityIncompatibleWorldSize."""
    if world_size not in valid:
        why = (
            valid
            if valid
            else "none: no batch size within max_train_batch_size suits any GPU count in [min_gpus, max_gpus]"
        )
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not valid for the elasticity block (train batch {batch}); valid world "
            f"sizes: {why}; run at one of them, or change {ELASTICITY}.max_train_batch_size / micro_batch_sizes / "
            "min_gpus / max_gpus"
        )
    return max(m for m in set(micro_batches) if batch // world_size % m == 0)


@dataclass(frozen=True)
class ElasticBatch:
    """The batch sizes an elastic job trains with at one data-parallel world size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]
    fallback: bool = False  # version 0.2 off its plan: this batch suits the current size only


def batch_at_world_size(block: ElasticityBlock, dp_world_size: int) -> ElasticBatch:
    """The engine's batch sizes for an enabled block at ``dp_world_size`` data-parallel ranks.

    Note [elastic world size]: DeepSpeed's runtime passes its data-parallel world size where version 0.2
    expects the GPU count (it divides by model_parallel_size again); the two agree when
    model_parallel_size is 1, the case DeepSpeed tests. Here version 0.2 plans at
    ``dp_world_size * model_parallel_size`` GPUs, what a scheduler passes, so the data-parallel size is
    checked against the data-parallel sizes the plan lists. The micro batch is the largest that divides
    the per-rank batch, and the accumulation steps make up the rest: the global batch is the same at
    every valid world size.
    """
    if not block.enabled:
        raise ElasticityConfigError(f"{ELASTICITY}.enabled is false; elastic batch sizes need an enabled block")
    batch, valid, _, fallback = plan(block, dp_world_size * block.model_parallel_size)
    micro = micro_for_world(batch, dp_world_size, valid, block.micro_batch_sizes)
    return ElasticBatch(batch, micro, batch // (micro * dp_world_size), tuple(valid), fallback)


# --- the runtime rule -----------------------------------------------------------------------------


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Check that the elastic config the resource scheduler planned with (``$DEEPSPEED_ELASTICITY_CONFIG``,
    JSON: the elasticity block, or a whole config holding one) matches the one this job runs with."""
    text = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if text is None:  # DeepSpeed warns; under torch's elastic agent there is no such scheduler, so: info
        logger.info(
            "[elasticity] $%s is not set: no resource scheduler's plan to check this elastic config against",
            DEEPSPEED_ELASTICITY_CONFIG,
        )
        return
    try:
        scheduled = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ElasticityConfigError(f"${DEEPSPEED_ELASTICITY_CONFIG} is not JSON ({exc})") from None
    if isinstance(scheduled, dict) and isinstance(scheduled.get(ELASTICITY), dict):
        scheduled = scheduled[ELASTICITY]
    planned, running = validate_block(scheduled), validate_block(runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(planned, key) != getattr(running, key):
            raise ElasticityConfigError(
                f"{ELASTICITY}.{key} is {getattr(running, key)} in this job's config but the resource scheduler "
                f"planned with {getattr(planned, key)} (${DEEPSPEED_ELASTICITY_CONFIG}); give both the same block"
            )


def resolve_elastic_batch_size(
    block: ElasticityBlock, world_size: int, given_keys: Iterable[str] = ()
) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)`` for an enabled ``elasticity``
    block (``ZeroSpeedConfig.elasticity``) at ``world_size`` data-parallel ranks: DeepSpeed's runtime rule.

    ``given_keys`` are the batch keys the config itself sets. Elasticity owns the batch sizes, so they are
    an ``ElasticityConfigError`` unless ``ignore_non_elastic_batch_info`` is true (then they are
    overridden, with a warning naming each).
    """
    check_block(block)
    given = [key for key in BATCH_KEYS if key in set(given_keys)]
    if given and not block.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"{', '.join(given)} set outside the {ELASTICITY} block: an enabled {ELASTICITY} block sets the batch "
            f"sizes itself at every world size, so these would not be used; remove them, or set "
            f"{ELASTICITY}.ignore_non_elastic_batch_info: true to have them ignored"
        )
    ensure_immutable_elastic_config(block.model_dump(include=block.model_fields_set))
    chosen = batch_at_world_size(block, world_size)
    if chosen.fallback:
        logger.warning(
            "[elasticity] %d data-parallel ranks is not a size the elasticity block plans for, so version "
            "0.2 trains with train_batch_size %d here, which suits this size only: the global batch "
            "differs from that at the planned sizes",
            world_size,
            chosen.train_batch_size,
        )
    for key, value in zip(
        BATCH_KEYS, (chosen.train_batch_size, chosen.micro_batch_size, chosen.gradient_accumulation_steps)
    ):
        if key in given:
            logger.warning("[elasticity] overriding %s from the config with %d", key, value)
    logger.info(
        "[elasticity] train_batch_size %d = micro batch %d x gradient_accumulation_steps %d x %d "
        "data-parallel ranks; valid data-parallel sizes %s",
        chosen.train_batch_size,
        chosen.micro_batch_size,
        chosen.gradient_accumulation_steps,
        world_size,
        list(chosen.valid_world_sizes),
    )
    return chosen.train_batch_size, chosen.micro_batch_size, chosen.gradient_accumulation_steps


__all__ = [
    "DEEPSPEED_ELASTICITY_CONFIG",
    "ELASTICITY",
    "ELASTICITY_VERSIONS",
    "HCN_LIST",
    "LATEST_ELASTICITY_VERSION",
    "ElasticBatch",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "batch_at_world_size",
    "check_block",
    "check_version",
    "ensure_immutable_elastic_config",
    "get_best_candidates",
    "get_candidate_batch_sizes",
    "get_valid_gpus",
    "micro_for_world",
    "plan",
    "resolve_elastic_batch_size",
    "validate_block",
]
