"""DeepSpeed's module paths as aliases of zerospeed's concept modules: the one alias table.

Note [the alias layer]: every implementation lives in the package of its concept (`optim/onebit`,
`data/`, `precision/autocast.py`, ...). DeepSpeed's public paths reach it through this table, and
only through it: `zerospeed.runtime.fp16.onebit.adam` *is* the module `zerospeed.optim.onebit.adam`
(one module object under two names, so `isinstance`, module globals and monkeypatches agree), and
`deepspeed.X` through the shim (compat/alias.py) is `zerospeed.X`. Nothing at an alias path is a
file: a path is either

- a string: that concept module itself (and its submodules under the alias, by prefix:
  `runtime.fp16.onebit.lamb` is `zerospeed.optim.onebit.lamb`);
- a dict: a facade module for a DeepSpeed module whose names come from several concept modules,
  each name resolved on first use (`"module:attr"`, or `"module"` for a module);
- None: a namespace package whose children are table entries.

`NAMES` adds DeepSpeed's names to real zerospeed packages whose DeepSpeed counterpart exports more
than the concept package does (`deepspeed.utils.safe_get_full_grad`); those packages serve them with
`__getattr__ = package_getattr(__name__)`. This module imports nothing of zerospeed: the targets are
strings, imported when first used, so the table sits at the bottom of the layers and can name any of
them (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

PREFIX = "zerospeed."

MODULES: dict[str, str | dict[str, str] | None] = {
    # deepspeed.git_version_info: DeepSpeed's version (the API zerospeed mirrors) and its op reports
    "git_version_info": {
        "version": "zerospeed.version:version",
        "git_hash": "zerospeed.version:git_hash",
        "git_branch": "zerospeed.version:git_branch",
        "installed_ops": "zerospeed.ops.builders:installed_ops",
        "compatible_ops": "zerospeed.ops.builders:compatible_ops",
        "torch_info": "zerospeed.ops.builders:torch_info",
    },
    # deepspeed.runtime: the engine is zerospeed.runtime itself; the rest lives with its concept
    "runtime.activation_checkpointing": None,
    "runtime.activation_checkpointing.checkpointing": "zerospeed.activation",
    "runtime.comm": None,
    "runtime.comm.compressed": "zerospeed.comm.compressed",
    "runtime.comm.nccl": "zerospeed.comm.compressed",
    "runtime.comm.mpi": "zerospeed.comm.compressed",
    "runtime.comm.hccl": "zerospeed.comm.compressed",
    "runtime.data_pipeline": {"CurriculumScheduler": "zerospeed.data.curriculum:CurriculumScheduler"},
    "runtime.data_pipeline.curriculum_scheduler": "zerospeed.data.curriculum",
    "runtime.data_pipeline.data_routing": "zerospeed.data.random_ltd",
    "runtime.data_pipeline.data_routing.basic_layer": "zerospeed.data.random_ltd.layer",
    "runtime.data_pipeline.data_sampling": None,
    "runtime.data_pipeline.data_sampling.data_analyzer": "zerospeed.data.analyzer",
    "runtime.data_pipeline.data_sampling.data_sampler": "zerospeed.data.sampler",
    "runtime.data_pipeline.data_sampling.indexed_dataset": {
        "MMapIndexedDataset": "zerospeed.data.indexed:IndexedFile",
    },
    "runtime.config": "zerospeed.config.deepspeed",
    "runtime.config_utils": {"DeepSpeedConfigModel": "zerospeed.config.deepspeed:DeepSpeedConfigModel"},
    "runtime.dataloader": "zerospeed.data.loader",
    "runtime.fp16": None,
    "runtime.fp16.onebit": "zerospeed.optim.onebit",
    # DeepSpeed's optimizer wrappers are zerospeed's strategies (the owners of the fp32 masters); the engine's
    # `optimizer` is the torch optimizer over those masters, an instance of none of them (docs/compat.md)
    "runtime.fp16.fused_optimizer": {"FP16_Optimizer": "zerospeed.zero.stage0:DataParallelStrategy"},
    "runtime.fp16.unfused_optimizer": {"FP16_UnfusedOptimizer": "zerospeed.zero.stage0:DataParallelStrategy"},
    "runtime.zero.stage_1_and_2": {"DeepSpeedZeroOptimizer": "zerospeed.zero.sharded:ShardedStrategy"},
    "runtime.zero.stage3": {"DeepSpeedZeroOptimizer_Stage3": "zerospeed.zero.stage3.strategy:Stage3Strategy"},
    "runtime.lr_schedules": "zerospeed.optim.schedulers",
    "runtime.pipe": {
        "PipelineModule": "zerospeed.parallel.pipeline.module:PipelineModule",
        "LayerSpec": "zerospeed.parallel.pipeline.module:LayerSpec",
        "TiedLayerSpec": "zerospeed.parallel.pipeline.module:TiedLayerSpec",
        "ProcessTopology": "zerospeed.parallel.pipeline.topology:ProcessTopology",
    },
    "runtime.pipe.engine": "zerospeed.runtime.pipeline",
    "runtime.pipe.schedule": "zerospeed.parallel.pipeline.clocked",
    "runtime.pipe.module": "zerospeed.parallel.pipeline.module",
    "runtime.pipe.topology": {
        "ProcessTopology": "zerospeed.parallel.pipeline.topology:ProcessTopology",
        "PipeDataParallelTopology": "zerospeed.parallel.pipeline.topology:PipeDataParallelTopology",
        "PipeModelDataParallelTopology": "zerospeed.parallel.pipeline.topology:PipeModelDataParallelTopology",
        "PipelineParallelGrid": "zerospeed.parallel.pipeline.grid:PipelineParallelGrid",
        "_prime_factors": "zerospeed.parallel.pipeline.grid:_prime_factors",
    },
    "runtime.precision_config": {"get_bfloat16_config": "zerospeed.config.deepspeed:get_bfloat16_config"},
    "runtime.progressive_layer_drop": "zerospeed.data.progressive_layer_drop",
    "runtime.sequence_parallel": None,
    "runtime.sequence_parallel.ulysses_sp": {
        "TiledMLP": "zerospeed.sequence.tiled:TiledMLP",
        "UlyssesSPAttentionHF": "zerospeed.sequence.hf:UlyssesSPAttentionHF",
        "UlyssesSPDataLoaderAdapter": "zerospeed.sequence.data:UlyssesSPDataLoaderAdapter",
    },
    "runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": "zerospeed.offload.swap:MIN_SWAPPABLE_BYTES"},
    "runtime.torch_autocast": "zerospeed.precision.autocast",
    "runtime.utils": {
        "move_to_device": "zerospeed.utils.tensors:move_to_device",
        "set_random_seed": "zerospeed.accelerator:set_random_seed",
        "partition_uniform": "zerospeed.parallel.pipeline.partition:partition_uniform",
        "partition_balanced": "zerospeed.parallel.pipeline.partition:partition_balanced",
        "prefix_sum_inc": "zerospeed.parallel.pipeline.partition:prefix_sum_inc",
        "PartitionedTensor": "zerospeed.comm.partitioned:PartitionedTensor",
        "call_to_str": "zerospeed.parallel.pipeline.clocked:call_to_str",
        "clip_grad_norm_": "zerospeed.parallel.clipping:clip_grad_norm_",
        "count_used_parameters_in_backward": "zerospeed.utils.tensors:count_used_parameters_in_backward",
        "see_memory_usage": "zerospeed.profiling.memory_usage:see_memory_usage",
    },
    "runtime.zero": {
        "Init": "zerospeed.zero.stage3.api:Init",
        "GatheredParameters": "zerospeed.zero.stage3.api:GatheredParameters",
        "register_external_parameter": "zerospeed.zero.stage3.api:register_external_parameter",
        "TiledLinear": "zerospeed.zero.stage3.tiling:TiledLinear",
        "TiledLinearReturnBias": "zerospeed.zero.stage3.tiling:TiledLinearReturnBias",
    },
    "runtime.zero.tiling": "zerospeed.zero.stage3.tiling",
    "runtime.zero.linear": "zerospeed.zero.stage3.linear",
    "runtime.zero.config": {
        "DeepSpeedZeroConfig": "zerospeed.config.deepspeed:DeepSpeedZeroConfig",
        "ZeroStageEnum": "zerospeed.config.deepspeed:ZeroStageEnum",
        "DeepSpeedZeroOffloadParamConfig": "zerospeed.config.schema.offload:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": "zerospeed.config.schema.offload:OffloadOptimizerConfig",
        "OffloadDeviceEnum": "zerospeed.offload.states:OffloadDeviceEnum",
    },
    "runtime.zero.leaf_module_config": {
        "DeepSpeedZeroLeafModuleConfig": "zerospeed.config.schema.zero:LeafModuleConfig",
        "DEFAULT_LEAF_MODULE_CLASSES": "zerospeed.config.deepspeed:DEFAULT_LEAF_MODULE_CLASSES",
        "DEFAULT_LEAF_MODULE_NAMES": "zerospeed.config.deepspeed:DEFAULT_LEAF_MODULE_NAMES",
        "DEFAULT_LEAF_MODULE_NAME_SUFFIXES": "zerospeed.config.deepspeed:DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    },
    "runtime.zero.offload_config": {
        "OffloadDeviceEnum": "zerospeed.offload.states:OffloadDeviceEnum",
        "OffloadStateTypeEnum": "zerospeed.offload.states:OffloadStateTypeEnum",
        "DeepSpeedZeroOffloadParamConfig": "zerospeed.config.schema.offload:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": "zerospeed.config.schema.offload:OffloadOptimizerConfig",
    },
    "runtime.zero.offload_states": "zerospeed.offload.states",
    "runtime.zero.partition_parameters": "zerospeed.zero.stage3.api",
    "runtime.zero.utils": {"ZeRORuntimeException": "zerospeed.utils.errors:ZeRORuntimeException"},
    "runtime.zero.muon": None,  # DeepSpeed's Muon (optim/muon.py)
    "runtime.zero.muon.muon_optimizer": {
        "MuonWithAuxAdam": "zerospeed.optim.muon:MuonWithAuxAdam",
        "muon_update": "zerospeed.optim.muon:muon_update",
        "adam_update": "zerospeed.optim.muon:adam_update",
    },
    "runtime.zero.muon.original_muon": {
        "muon_update": "zerospeed.optim.muon:muon_update",
        "adam_update": "zerospeed.optim.muon:adam_update",
        "ns_compute_dtype": "zerospeed.optim.muon:ns_compute_dtype",
        "zeropower_via_newtonschulz5": "zerospeed.optim.muon:zeropower_via_newtonschulz5",
        "zeropower_via_gram_newtonschulz": "zerospeed.optim.muon:zeropower_via_gram_newtonschulz",
        "NS_METHODS": "zerospeed.optim.muon:NS_METHODS",
        "SingleDeviceMuonWithAuxAdam": "zerospeed.optim.muon:MuonWithAuxAdam",
    },
    # deepspeed.pipe, deepspeed.checkpointing (activation checkpointing)
    "pipe": {
        "PipelineModule": "zerospeed.parallel.pipeline.module:PipelineModule",
        "LayerSpec": "zerospeed.parallel.pipeline.module:LayerSpec",
        "TiedLayerSpec": "zerospeed.parallel.pipeline.module:TiedLayerSpec",
        "PipelineEngine": "zerospeed.runtime.pipeline:PipelineEngine",
        "ProcessTopology": "zerospeed.parallel.pipeline.topology:ProcessTopology",
        "PipeDataParallelTopology": "zerospeed.parallel.pipeline.topology:PipeDataParallelTopology",
        "PipeModelDataParallelTopology": "zerospeed.parallel.pipeline.topology:PipeModelDataParallelTopology",
    },
    "checkpointing": "zerospeed.activation",
    # deepspeed.utils
    "utils.groups": "zerospeed.parallel.groups",
    "utils.numa": {"parse_range_list": "zerospeed.launcher.cores:parse_core_list"},
    "utils.tensor_fragment": "zerospeed.zero.tensor_access",
    "utils.timer": {"trim_mean": "zerospeed.profiling.timers:trim_mean"},
    "utils.torch": {"required_torch_version": "zerospeed.version:required_torch_version"},
    "utils.z3_leaf_module": "zerospeed.zero.leaf_modules",
    "utils.zero_to_fp32": "zerospeed.checkpoint.consolidate",
    # deepspeed.ops: no compiled ops; the optimizers and the quantizer in their concept packages
    "ops.adam": "zerospeed.optim.adam",
    "ops.adagrad": "zerospeed.optim.adagrad",
    "ops.lion": "zerospeed.optim.lion",
    "ops.quantizer": "zerospeed.precision.quantize",
    "ops.op_builder": "zerospeed.ops.builders",
    "ops.aio": {"AsyncIOBuilder": "zerospeed.ops.builders:AsyncIOBuilder"},
    # deepspeed.profiling.flops_profiler
    "profiling.flops_profiler": {
        "FlopsProfiler": "zerospeed.profiling.profiler:FlopsProfiler",
        "get_model_profile": "zerospeed.profiling.model_profile:get_model_profile",
    },
    "ops.deepspeed4science": {
        "DS4Sci_EvoformerAttention": "zerospeed.ops.evoformer:DS4Sci_EvoformerAttention",
        "EvoformerFusedAttention": "zerospeed.ops.evoformer:EvoformerFusedAttention",
    },
    "ops.deepspeed4science.evoformer_attn": "zerospeed.ops.evoformer",
    # deepspeed.launcher.runner
    "launcher.runner": {
        "main": "zerospeed.launcher.deepspeed_runner:main",
        "DEEPSPEED_ENVIRONMENT_NAME": "zerospeed.launcher.multinode:ENV_FILE_NAME",
        **{
            name: f"zerospeed.launcher.deepspeed_runner:{name}"
            for name in (
                "parse_args",
                "encode_world_info",
                "decode_world_info",
                "fetch_hostfile",
                "_parse_hostfile",
                "parse_resource_filter",
                "parse_inclusion_exclusion",
            )
        },
    },
    # zerospeed's own earlier paths, kept for code written against them
    "config.errors": "zerospeed.utils.errors",
    "inference.quantize": "zerospeed.compression.weight_quant",
}

_TENSOR_ACCESS = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
    "safe_set_full_grad",
    "safe_set_local_grad",
    "safe_update_full_grad_vectorized",
)
_LEAF_MODULES = (
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_parameter",
)

NAMES: dict[str, dict[str, str]] = {
    "zerospeed.utils": {
        "RepeatingLoader": "zerospeed.data.loader:RepeatingLoader",
        **{n: f"zerospeed.zero.tensor_access:{n}" for n in _TENSOR_ACCESS},
        **{n: f"zerospeed.zero.leaf_modules:{n}" for n in _LEAF_MODULES},
    },
    "zerospeed.ops": {"__compatible_ops__": "zerospeed.ops.builders:compatible_ops"},
    # the pipeline engine is an engine (runtime, a layer above parallel): served here, not imported there
    "zerospeed.parallel.pipeline": {
        "PipelineEngine": "zerospeed.runtime.pipeline:PipelineEngine",
        "PipelineError": "zerospeed.runtime.pipeline:PipelineError",
    },
}


def resolve(target: str):
    """`"module:attr"` -> that attribute; `"module"` -> that module."""
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def _is_namespace(key: str) -> bool:
    return any(k.startswith(key + ".") for k in MODULES)


def _target(key: str) -> str | dict[str, str] | None | bool:
    """The table's value for `key` (a path under zerospeed), by prefix for a string alias's children;
    False when the table does not know the path."""
    if key in MODULES:
        return MODULES[key]
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = MODULES.get(".".join(parts[:cut]), False)
        if isinstance(head, str):
            return ".".join([head, *parts[cut:]])
        if head is not False:
            return False  # a facade or namespace has only the children the table names
    return False


def _facade(fullname: str, names: dict[str, str] | None) -> types.ModuleType:
    key = fullname[len(PREFIX) :]
    module = types.ModuleType(
        fullname,
        f"DeepSpeed's `deepspeed.{key}`: an alias of zerospeed's concept modules (zerospeed/deepspeed_paths.py).",
    )
    names = dict(names or {})
    if names:
        module.__all__ = sorted(n for n in names if not n.startswith("_"))

    def __getattr__(attr: str):
        if attr in names:
            value = resolve(names[attr])
            setattr(module, attr, value)
            return value
        if not attr.startswith("__") and _target(f"{key}.{attr}") is not False:
            return importlib.import_module(f"{fullname}.{attr}")
        raise AttributeError(f"module {fullname!r} has no attribute {attr!r}")

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted(set(names) | set(vars(module)))
    return module


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target
        self._spec = None

    def create_module(self, spec):
        if isinstance(self.target, str):
            module = importlib.import_module(self.target)
            self._spec = module.__spec__
            return module
        return _facade(spec.name, self.target)

    def exec_module(self, module) -> None:
        if self._spec is not None:  # the import system set the alias's spec on the shared module: undo it
            module.__spec__ = self._spec


class _Finder(importlib.abc.MetaPathFinder):
    """`zerospeed.<DeepSpeed path>` -> the table's module (Note [the alias layer])."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PREFIX):
            return None
        key = fullname[len(PREFIX) :]
        found = _target(key)
        if found is False:
            return None
        if isinstance(found, str):
            real = importlib.util.find_spec(found)
            if real is None:
                return None
            is_package = real.submodule_search_locations is not None
        else:
            is_package = _is_namespace(key)
        spec = importlib.util.spec_from_loader(fullname, _AliasLoader(found), is_package=is_package)
        if is_package and not isinstance(found, str):
            spec.submodule_search_locations = []
        return spec


_FINDER = _Finder()


def install() -> None:
    """Serve the table's paths (done by `import zerospeed`)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def package_getattr(package: str):
    """A module `__getattr__` for a real package: DeepSpeed's extra names (`NAMES`), then submodules
    (real or aliases) reachable as attributes before they are imported, as DeepSpeed's are (`import
    deepspeed` imports most of DeepSpeed, so code reads `deepspeed.runtime.lr_schedules.X` directly)."""
    extra = NAMES.get(package, {})

    def __getattr__(name: str):
        if name in extra:
            value = resolve(extra[name])
            setattr(sys.modules[package], name, value)
            return value
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
