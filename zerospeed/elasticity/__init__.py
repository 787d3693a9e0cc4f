"""Elastic training: DeepSpeed's ``deepspeed.elasticity`` (docs/elasticity.md).

``compute_elastic_config`` picks a global batch size that many GPU counts can train with; with the
``elasticity`` block enabled the engine takes its batch sizes from it at the current world size, so a
job restarted by torch's elastic agent at another size (resuming from its last checkpoint, which
reshards on load) keeps the global batch and changes only the gradient accumulation steps.
DeepSpeed's ``DSElasticAgent`` is not provided: torch's own agent runs the workers.
"""

from zerospeed.elasticity.config import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)
from zerospeed.elasticity.constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from zerospeed.elasticity.elasticity import (
    ElasticBatch,
    compute_elastic_config,
    elastic_batch,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from zerospeed.elasticity.utils import is_torch_elastic_compatible

__all__ = [
    "ELASTICITY",
    "ENABLED",
    "ENABLED_DEFAULT",
    "ElasticBatch",
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elastic_batch",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
    "is_torch_elastic_compatible",
]
