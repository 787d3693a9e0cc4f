"""The ``elasticity`` block as DeepSpeed's ``ElasticityConfig`` object, and DeepSpeed's elasticity errors.

The block is typed once, by the config schema (``zerospeed.config.schema.misc.ElasticityConfig``), and
checked by ``zerospeed.config.elastic`` (Note [elastic block checks] there), which also defines the errors
(Note [elasticity errors are config errors]): an enabled block sets the batch sizes while the config is
parsed. ``ElasticityConfig(param_dict)`` here is DeepSpeed's view of a checked block, under DeepSpeed's
attribute names (``max_acceptable_batch_size``, ``micro_batches``, ``prefer_larger_batch_size``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from zerospeed.config.elastic import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    check_block,
    validate_block,
)
from zerospeed.config.schema.misc import ElasticityConfig as ElasticityBlock

# schema field -> DeepSpeed's attribute name, for the keys whose names differ (the others keep the key's name)
_DEEPSPEED_NAMES = {
    "max_train_batch_size": "max_acceptable_batch_size",
    "micro_batch_sizes": "micro_batches",
    "prefer_larger_batch": "prefer_larger_batch_size",
}


class ElasticityConfig:
    """DeepSpeed's ``ElasticityConfig(param_dict)``: a checked block under DeepSpeed's attribute names."""

    def __init__(self, param_dict: Mapping[str, Any]):
        self._assign(validate_block(param_dict))

    @classmethod
    def from_block(cls, block: ElasticityBlock) -> ElasticityConfig:
        """The object for a block the config schema has already typed (``ZeroSpeedConfig.elasticity``)."""
        check_block(block)
        config = cls.__new__(cls)
        config._assign(block)
        return config

    def _assign(self, block: ElasticityBlock) -> None:
        for key in ElasticityBlock.model_fields:
            value = getattr(block, key)
            setattr(self, _DEEPSPEED_NAMES.get(key, key), list(value) if isinstance(value, list) else value)

    def to_block(self) -> ElasticityBlock:
        """The schema's block with this object's current values (DeepSpeed code may have changed them)."""
        values = {key: getattr(self, _DEEPSPEED_NAMES.get(key, key)) for key in ElasticityBlock.model_fields}
        return ElasticityBlock.model_construct(**values)

    def repr(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)


__all__ = [
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "check_block",
    "validate_block",
]
