"""DeepSpeed's elasticity constants: the block's key names and defaults (``deepspeed.elasticity.constants``).

The defaults are read off the config schema (``zerospeed.config.schema.misc.ElasticityConfig``), the one
place they are written, so the two cannot disagree.
"""

from __future__ import annotations

from zerospeed.config.elastic import (  # noqa: F401 (re-exported; the plan's own names, written there)
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ELASTICITY_VERSIONS,
    LATEST_ELASTICITY_VERSION,
)
from zerospeed.config.schema.misc import ElasticityConfig as _Block


def _default(key: str):
    default = _Block.model_fields[key].default
    return list(default) if isinstance(default, list) else default


ENABLED = "enabled"
ENABLED_DEFAULT = _default(ENABLED)
MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = _default(MAX_ACCEPTABLE_BATCH_SIZE)
MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = _default(MICRO_BATCHES)
MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = _default(MIN_GPUS)
MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = _default(MAX_GPUS)
NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = _default(NUM_GPUS_PER_NODE)
MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = _default(MODEL_PARALLEL_SIZE)
MIN_TIME = "min_time"
MIN_TIME_DEFAULT = _default(MIN_TIME)
PREFER_LARGER_BATCH = "prefer_larger_batch"
PREFER_LARGER_BATCH_DEFAULT = _default(PREFER_LARGER_BATCH)
IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = _default(IGNORE_NON_ELASTIC_BATCH_INFO)
VERSION = "version"
VERSION_DEFAULT = _default(VERSION)

# The oldest DeepSpeed release with elasticity: an older ``target_deepspeed_version`` is refused.
MINIMUM_DEEPSPEED_VERSION = "0.3.8"

__all__ = [name for name in dir() if name.isupper()]
