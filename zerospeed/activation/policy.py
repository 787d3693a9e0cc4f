"""What ``configure()`` decides, resolved once: a frozen policy and the model-parallel group.

The six DeepSpeed switches come from the ``activation_checkpointing`` config section (a dict, a
JSON path, base64 JSON, or an already parsed ``ZeroSpeedConfig``), then explicit ``configure``
keyword arguments override them one by one. Everything downstream reads this policy object; no
code path re-reads the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from zerospeed import comm
from zerospeed.config.aliases import apply_aliases
from zerospeed.config.loader import load_raw
from zerospeed.config.schema.misc import ActivationCheckpointingConfig
from zerospeed.config.schema.root import ZeroSpeedConfig
from zerospeed.config.validation import validate_config
from zerospeed.utils.errors import ConfigError

SECTION = "activation_checkpointing"


@dataclass(frozen=True)
class CheckpointingPolicy:
    """The resolved ``activation_checkpointing`` switches (field names are the config keys)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


# configure() keeps DeepSpeed's keyword names, which differ from the config keys.
KWARG_TO_KEY: dict[str, str] = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


def config_section(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The validated ``activation_checkpointing`` section of whatever the user passed.

    Only this section is validated here (a config without batch sizes is fine for checkpointing);
    ``zerospeed.initialize`` validates the whole document.
    """
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, ZeroSpeedConfig):
        return deepspeed_config.activation_checkpointing
    raw = apply_aliases(load_raw(deepspeed_config))
    section = raw.get(SECTION)
    return validate_config({} if section is None else {SECTION: section}).activation_checkpointing


def _checked_override(kwarg: str, value: Any) -> Any:
    key = KWARG_TO_KEY[kwarg]
    if key == "number_checkpoints":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"configure({kwarg}={value!r}) ({SECTION}.{key}): expected a positive integer "
                "(the number of checkpoint() calls in one forward)"
            )
    elif not isinstance(value, bool):
        raise ConfigError(f"configure({kwarg}={value!r}) ({SECTION}.{key}): expected true or false")
    return value


def _check_contiguous(policy: CheckpointingPolicy) -> None:
    if policy.contiguous_memory_optimization and policy.number_checkpoints is None:
        raise ConfigError(
            f"{SECTION}.contiguous_memory_optimization=true needs {SECTION}.number_checkpoints: the number of "
            "checkpoint() calls in one forward, which sizes the one preallocated buffer; set it (or pass "
            "configure(num_checkpoints=N)), or set contiguous_memory_optimization to false"
        )


def resolve_policy(section: ActivationCheckpointingConfig, overrides: Mapping[str, Any]) -> CheckpointingPolicy:
    """Config values, then every non-None ``configure`` keyword on top (DeepSpeed's precedence)."""
    values = {f.name: getattr(section, f.name) for f in fields(CheckpointingPolicy)}
    for kwarg, value in overrides.items():
        if value is not None:
            values[KWARG_TO_KEY[kwarg]] = _checked_override(kwarg, value)
    policy = CheckpointingPolicy(**values)
    _check_contiguous(policy)
    return policy


@dataclass(frozen=True)
class ModelParallel:
    """The model-parallel group checkpointed inputs are partitioned over (``group=None``: none)."""

    group: Any = None
    rank: int = 0
    world_size: int = 1

    @property
    def partitions(self) -> bool:
        return self.world_size > 1


_MPU_METHODS = {
    "tensor": (
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size",
    ),
    "model": ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size"),
}


def model_parallel_from(mpu: Any) -> ModelParallel:
    """Read a Megatron-style ``mpu`` (tensor-parallel names preferred, as DeepSpeed does)."""
    if mpu is None:
        return ModelParallel()
    names = _MPU_METHODS["tensor" if hasattr(mpu, "get_tensor_model_parallel_rank") else "model"]
    missing = [n for n in names if not callable(getattr(mpu, n, None))]
    if missing:
        raise ConfigError(
            f"configure(mpu_=...): {type(mpu).__name__} lacks {', '.join(missing)}(); pass a "
            "Megatron-style mpu with get_model_parallel_group/rank/world_size, or mpu_=None"
        )
    group, rank, world = (getattr(mpu, n)() for n in names)
    mp = ModelParallel(group, int(rank), int(world))
    _check_against_group(mp, names[0])
    return mp


def _check_against_group(mp: ModelParallel, source: str) -> None:
    """The mpu's rank/size must describe its own group, or the all-gather would mix up pieces."""
    if not comm.is_initialized() or mp.world_size == 1:
        return
    actual = (comm.get_rank(mp.group), comm.get_world_size(mp.group))
    if actual != (mp.rank, mp.world_size):
        raise ConfigError(
            f"configure(mpu_=...): the mpu says rank {mp.rank} of {mp.world_size}, but the group "
            f"from {source}() is rank {actual[0]} of {actual[1]}; fix the mpu"
        )
