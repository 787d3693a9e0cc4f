"""DeepSpeed's config classes (`deepspeed.runtime.config`, `runtime.zero.config`, `runtime.config_utils`) as
views of zerospeed's typed config.

`DeepSpeedConfig(config, mpu=None)` parses the config with `parse_config` (the one parser: aliases, "auto"
with nothing known, validation, batch sizes over the data-parallel world) and exposes the result under
DeepSpeed's attribute names (`train_batch_size`, `zero_optimization_stage`, `fp16_enabled`, `optimizer_name`,
...); every other attribute reads the typed section of the same name (`cfg.zero_config` is the
`ZeroConfig`). `_param_dict` is the raw dict, as DeepSpeed keeps it. Features zerospeed has not built are not
refused here (a config object runs nothing): `initialize` refuses them.

`DeepSpeedZeroConfig(**section)` is zerospeed's `ZeroConfig` reading the old spellings DeepSpeed reads
(`cpu_offload`, `stage3_gather_fp16_weights_on_model_save`, ...) through the same alias rules as a full config.
`DeepSpeedConfigModel` is the base DeepSpeed's own config sections derive from: strict, fields settable by name
or alias, and DeepSpeed's deprecated-field convention (`json_schema_extra={"deprecated": True, "new_param":
..., "new_param_fn": ...}`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, model_validator

from zerospeed import comm
from zerospeed.config.aliases import apply_aliases
from zerospeed.config.batch import resolve_batch_size
from zerospeed.config.loader import load_raw
from zerospeed.config.parse import parse_config
from zerospeed.config.schema.base import StrictModel
from zerospeed.config.schema.offload import OffloadOptimizerConfig, OffloadParamConfig
from zerospeed.config.schema.precision import Bf16Config
from zerospeed.config.schema.zero import LeafModuleConfig, ZeroConfig
from zerospeed.utils.errors import ConfigAssertionError, ConfigError, DeepSpeedConfigError

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
    "get_bfloat16_config",
]

# DeepSpeed's names for the optimizer types its engine builds (`optimizer.type`, compared lower-case)
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER = "adagrad", "adam", "adamw"
LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER = "lamb", "onebitadam", "zerooneadam"
ONEBIT_LAMB_OPTIMIZER, LION_OPTIMIZER, MUADAM_OPTIMIZER = "onebitlamb", "lion", "muadam"
MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, MUON_OPTIMIZER = "muadamw", "musgd", "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    LION_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    MUON_OPTIMIZER,
]


class ZeroStageEnum:
    """DeepSpeed's names for the ZeRO stages (`runtime.zero.config.ZeroStageEnum`): plain ints, as the config's."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedConfigModel(StrictModel):
    """A strict config section that also takes DeepSpeed's deprecated-field convention: a field whose
    `json_schema_extra` says `"deprecated": True, "new_param": name` moves its value to `name` (through
    `new_param_fn` when given); setting both is an error (an `AssertionError`, as DeepSpeed's)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=(), validate_default=True)

    def __init__(self, **data: Any) -> None:
        # checked before validation: pydantic would turn the AssertionError into a ValidationError
        for old, new in self._deprecated_pairs():
            if old in data and new in data:
                raise ConfigAssertionError(f"{old} is deprecated and {new} is also given; keep only {new}")
        super().__init__(**data)

    @classmethod
    def _deprecated_pairs(cls) -> list[tuple[str, str]]:
        pairs = []
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("deprecated") and extra.get("new_param"):
                pairs.append((field.alias or name, extra["new_param"]))
        return pairs

    @model_validator(mode="before")
    @classmethod
    def _deprecated_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in cls._deprecated_pairs():
            if old in data and new not in data:
                extra = cls.model_fields[_field_named(cls, old)].json_schema_extra
                data[new] = extra.get("new_param_fn", lambda value: value)(data.pop(old))
        return data


def _field_named(model: type[StrictModel], key: str) -> str:
    """The field whose name or alias is `key`."""
    return next(name for name, field in model.model_fields.items() if key in (name, field.alias))


DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class DeepSpeedZeroConfig(ZeroConfig):
    """`zero_optimization` as DeepSpeed's class: zerospeed's `ZeroConfig`, built from keyword arguments with the
    old spellings read as a full config reads them (config/aliases.py)."""

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return apply_aliases({"zero_optimization": data})["zero_optimization"]


def get_bfloat16_config(param_dict: dict[str, Any]) -> Bf16Config:
    """The `bf16` section of a raw config (also under its old name `bfloat16`), validated."""
    raw = apply_aliases({key: param_dict[key] for key in ("bf16", "bfloat16") if key in param_dict})
    return Bf16Config(**raw.get("bf16", {}))


def _data_parallel_world_size(mpu) -> int:
    """DeepSpeed's `DeepSpeedConfig.world_size`: the ranks the batch is split over (1 without a process group)."""
    if not comm.is_initialized():
        return 1
    world = comm.get_world_size()
    if mpu is not None:
        getter = getattr(mpu, "get_data_parallel_world_size", None)
        if getter is not None:
            return int(getter())
        world //= int(mpu.get_model_parallel_world_size())
    return world


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class DeepSpeedConfig:
    """A DeepSpeed config (dict, JSON file path or base64 JSON), parsed and checked by zerospeed's parser, with
    DeepSpeed's attribute names. Invalid configs raise zerospeed's `ConfigError` (a `ValueError` and a
    `DeepSpeedConfigError`); a batch-size contradiction is also an `AssertionError`, as DeepSpeed's."""

    def __init__(self, config: Any, mpu=None, mesh_device=None) -> None:
        self._param_dict = apply_aliases(load_raw(config))
        self.mpu = mpu
        self.mesh_device = mesh_device
        self.world_size = _data_parallel_world_size(mpu)
        try:
            self.config = parse_config(self._param_dict, world_size=self.world_size, check_features=False)
        except ConfigError as exc:
            if any(key in str(exc) for key in _BATCH):
                raise ConfigAssertionError(str(exc)) from None
            raise
        self.train_batch_size = self.config.train_batch_size
        self.train_micro_batch_size_per_gpu = self.config.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = self.config.gradient_accumulation_steps

    def _configure_train_batch_size(self) -> None:
        """Derive the batch sizes again from the three attributes as they are set now (DeepSpeed's method)."""
        try:
            resolved = resolve_batch_size(
                self.train_batch_size,
                self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps,
                self.world_size,
            )
        except ConfigError as exc:
            raise ConfigAssertionError(str(exc)) from None
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = resolved

    # DeepSpeed's flat names for values of the typed sections
    zero_config = property(lambda self: self.config.zero_optimization)
    zero_optimization_stage = property(lambda self: self.config.zero_optimization.stage)
    zero_enabled = property(lambda self: self.config.zero_optimization.stage > 0)
    fp16_enabled = property(lambda self: self.config.fp16.enabled)
    bfloat16_enabled = property(lambda self: self.config.bf16.enabled)
    optimizer_name = property(lambda self: self.config.optimizer.type.lower() if self.config.optimizer else None)
    optimizer_params = property(lambda self: dict(self.config.optimizer.params) if self.config.optimizer else None)
    scheduler_name = property(lambda self: self.config.scheduler.type if self.config.scheduler else None)
    scheduler_params = property(lambda self: dict(self.config.scheduler.params) if self.config.scheduler else None)
    eigenvalue_enabled = property(lambda self: self.config.eigenvalue.enabled)
    eigenvalue_verbose = property(lambda self: self.config.eigenvalue.verbose)
    pld_enabled = property(lambda self: self.config.progressive_layer_drop.enabled)
    sparse_gradients_enabled = property(lambda self: self.config.sparse_gradients)
    zero_allow_untested_optimizer = property(lambda self: self.config.zero_allow_untested_optimizer)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "config":
            raise AttributeError(name)
        try:
            return getattr(self.config, name)
        except AttributeError:
            raise AttributeError(f"DeepSpeedConfig has no attribute {name!r}") from None

    def print(self, name: str) -> None:
        """Log the parsed config (DeepSpeed's `DeepSpeedConfig.print`)."""
        print(f"{name}:")
        print(self.config.model_dump_json(indent=2))


# DeepSpeed's `runtime.zero.leaf_module_config` defaults: those of zerospeed's `zero_optimization.leaf_module`
DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(LeafModuleConfig.model_fields["classes"].default)
DEFAULT_LEAF_MODULE_NAMES: list[str] = list(LeafModuleConfig.model_fields["names"].default)
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = list(LeafModuleConfig.model_fields["name_suffixes"].default)
