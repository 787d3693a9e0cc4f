"""The ``elasticity`` block as DeepSpeed's ``ElasticityConfig`` object, and DeepSpeed's elasticity errors.

The block is typed once, by the config schema (``zerospeed.config.schema.misc.ElasticityConfig``);
``ElasticityConfig(param_dict)`` here validates a raw block through that schema and adds the checks that
need more than one key (Note [elastic block checks]), exposing DeepSpeed's attribute names
(``max_acceptable_batch_size``, ``micro_batches``, ``prefer_larger_batch_size``).

Note [elasticity errors are config errors]: DeepSpeed's three exception types keep their names and their
hierarchy (both others derive from ``ElasticityError``), and ``ElasticityError`` derives from zerospeed's
``ConfigError`` (itself a ``ValueError``): ``parse_config`` promises that every problem is a
``ConfigError``, and DeepSpeed code that catches ``ElasticityError`` (or the ``ValueError`` DeepSpeed
raises for a micro batch above the maximum) still catches ours.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from zerospeed.utils.errors import ConfigError
from zerospeed.config.schema.misc import ElasticityConfig as ElasticityBlock
from zerospeed.config.validation import validate_config  # the root schema names keys as elasticity.<key>
from zerospeed.elasticity.constants import ELASTICITY, MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES


class ElasticityError(ConfigError):
    """Base of every elasticity error (Note [elasticity errors are config errors])."""


class ElasticityConfigError(ElasticityError):
    """The elasticity block is missing, disabled or inconsistent."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The current world size is not one the elastic config supports."""


def check_block(block: ElasticityBlock) -> None:
    """Raise ``ElasticityConfigError`` for a typed block whose keys do not make sense together.

    Note [elastic block checks]: the schema types each key (positive GPU counts, a list of integers);
    these are DeepSpeed's checks across keys: when enabled, the two batch keys must be written out
    (their defaults are never used silently), every micro batch must be positive, and min_gpus may not
    exceed max_gpus. The version and model-parallel checks belong to ``compute_elastic_config``.
    """
    if block.enabled:
        missing = [k for k in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES) if k not in block.model_fields_set]
        if missing:
            raise ElasticityConfigError(
                f"{' and '.join(f'{ELASTICITY}.{k}' for k in missing)} missing: an enabled elasticity block must "
                f"give the largest acceptable global batch ({MAX_ACCEPTABLE_BATCH_SIZE}) and the acceptable micro "
                f"batches ({MICRO_BATCHES}), e.g. \"{MAX_ACCEPTABLE_BATCH_SIZE}\": 2000, "
                f"\"{MICRO_BATCHES}\": [2, 4, 6]")
    micro = block.micro_batch_sizes
    if not micro or any(m < 1 for m in micro):
        raise ElasticityConfigError(f"{ELASTICITY}.{MICRO_BATCHES} must list positive integers (at least one), "
                                    f"got {micro}")
    if block.min_gpus > block.max_gpus:
        raise ElasticityConfigError(f"{ELASTICITY}.min_gpus {block.min_gpus} is greater than {ELASTICITY}.max_gpus "
                                    f"{block.max_gpus}; make min_gpus <= max_gpus")


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


class ElasticityConfig:
    """DeepSpeed's ``ElasticityConfig(param_dict)``: a checked block under DeepSpeed's attribute names."""

    def __init__(self, param_dict: Mapping[str, Any]):
        self._assign(validate_block(param_dict))

    @classmethod
    def from_block(cls, block: ElasticityBlock) -> "ElasticityConfig":
        """The object for a block the config schema has already typed (``ZeroSpeedConfig.elasticity``)."""
        check_block(block)
        config = cls.__new__(cls)
        config._assign(block)
        return config

    def _assign(self, block: ElasticityBlock) -> None:
        self.enabled = block.enabled
        self.max_acceptable_batch_size = block.max_train_batch_size
        self.micro_batches = list(block.micro_batch_sizes)
        self.min_gpus = block.min_gpus
        self.max_gpus = block.max_gpus
        self.model_parallel_size = block.model_parallel_size
        self.num_gpus_per_node = block.num_gpus_per_node
        self.min_time = block.min_time
        self.version = block.version
        self.prefer_larger_batch_size = block.prefer_larger_batch
        self.ignore_non_elastic_batch_info = block.ignore_non_elastic_batch_info

    def repr(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)


__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize",
           "check_block", "validate_block"]
