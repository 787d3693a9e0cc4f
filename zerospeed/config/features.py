"""The one table of config features that parse but are not implemented yet.

Each row is ``(dotted key, predicate, feature name, value to set instead)``; a row fires when its
predicate is true for the parsed config. When a feature lands, delete its row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel

from zerospeed.config.schema.base import show
from zerospeed.config.schema.root import ZeroSpeedConfig
from zerospeed.utils.errors import ConfigError

Cfg = ZeroSpeedConfig


class Row(NamedTuple):
    """One not-yet-implemented feature switch."""

    key: str
    requested: Callable[[Cfg], bool]
    feature: str | Callable[[Any], str]
    default: str


def _device(section: Any) -> str:
    return section.device if section is not None else "none"


def _uses_nvme(cfg: Cfg) -> bool:
    zero = cfg.zero_optimization
    return "nvme" in (_device(zero.offload_optimizer), _device(zero.offload_param))


def _switch(key: str, feature: str) -> Row:
    """A boolean switch that must stay false."""
    return Row(key, lambda cfg: _get(cfg, key) is True, feature, "false")


def _present(key: str, feature: str) -> Row:
    """A section whose mere presence requests the feature."""
    return Row(key, lambda cfg: _get(cfg, key) is not None, feature, "null (remove it)")


# DeepSpeed 0.19.8 removed these features (its config refuses the keys too)
_GONE = " (DeepSpeed 0.19.8 removed it as well: deepspeedai/DeepSpeed#8489)"

ROWS: list[Row] = [
    _switch("zero_optimization.offload_optimizer.super_offload", "SuperOffload"),
    Row("aio.use_gds", lambda c: c.aio.use_gds and _uses_nvme(c), "GPUDirect Storage", "false"),
    _present("zero_optimization.zenflow", "ZenFlow"),
    # (zero_quantized_weights, zero_quantized_gradients, zero_quantized_nontrainable_weights and
    # zero_hpz_partition_size work at stage 3: zero/stage3/zeropp.py, which refuses them at other stages)
    _present("zero_optimization.zeropp_loco_param", "LoCo-ZeRO++" + _GONE),
    _switch("zero_optimization.mics_hierarchical_params_gather", "MiCS hierarchical gather" + _GONE),
    _switch("amp.enabled", "apex AMP" + _GONE),
    _switch("fp16.fp16_master_weights_and_grads", "fp16 master weights and gradients"),
    _present("data_types.param_dtype", "casting parameters with data_types.param_dtype"),
    _present("data_types.buffer_dtype", "casting buffers with data_types.buffer_dtype"),
    _switch("optimizer.legacy_fusion", "the legacy fused optimizer"),
    # (nn.Embedding(sparse=True) gradients need no flag: Note [sparse gradients] in zero/reducer.py)
    _switch("sparse_gradients", "sparse compression of dense embedding gradients" + _GONE),
    _switch("disable_allgather", "disabling the parameter all-gather"),
    _switch("graph_harvesting", "graph harvesting" + _GONE),
    Row(
        "managed_gradient_accumulation",
        lambda c: not c.managed_gradient_accumulation,
        "caller-managed gradient accumulation",
        "true",
    ),
    _switch("disable_python_gc", "disabling Python's garbage collector"),
    # (compression_training: every technique is built, zerospeed/compression; it validates the block)
    # (weight_quantization: weight-only int8 / int4 of linear layers, compression/weight_quant/layer.py)
    # (data_efficiency.data_routing.random_ltd works: data/random_ltd; DeepSpeed's switches of
    # the curriculum data sampler are its two below)
    _switch(
        "data_efficiency.data_sampling.enabled",
        "curriculum data sampling (the data efficiency library's data sampler and offline data analyzer)",
    ),
    _switch(
        "data_efficiency.data_sampling.curriculum_learning.enabled",
        "curriculum data sampling (the data efficiency library's data sampler and offline data analyzer)",
    ),
    _switch(
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        "random-LTD's layer-token learning-rate schedule (DeepSpeed refuses it too)",
    ),
    _switch("eigenvalue.enabled", "eigenvalue computation" + _GONE),
    _switch("quantize_training.enabled", "MoQ quantize_training" + _GONE),
    Row("pipeline.stages", lambda c: c.pipeline.stages != "auto", "pipeline parallelism", '"auto"'),
    Row("pipeline.partition", lambda c: c.pipeline.partition != "best", "pipeline partitioning", '"best"'),
    _switch("pipeline.seed_layers", "pipeline layer seeding"),
    Row(
        "pipeline.activation_checkpoint_interval",
        lambda c: c.pipeline.activation_checkpoint_interval != 0,
        "pipeline activation checkpointing",
        "0",
    ),
    _switch("compile.deepcompile", "DeepCompile"),
    _switch("nebula.enabled", "Nebula checkpointing" + _GONE),
    _present("datastates_ckpt", "DataStates checkpointing"),
    _present("casync_ckpt", "CAsync checkpointing"),
    _switch("async_load", "asynchronous checkpoint loading"),
    _switch("checkpoint.load_universal", "universal checkpoint loading"),
    _switch("checkpoint.use_node_local_storage", "node-local checkpoint storage"),
    _switch("checkpoint.parallel_write.pipeline_stage", "parallel checkpoint writes"),
    _present("checkpoint.writer", "the fast checkpoint writer"),
]


def _get(cfg: Cfg, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if node is None:
            return None
        node = getattr(node, part)
    return node


def _render(value: Any) -> str:
    return "{...}" if isinstance(value, BaseModel) else show(value)


def _message(row: Row, value: Any) -> str:
    feature = row.feature(value) if callable(row.feature) else row.feature
    return (
        f"{row.key}={_render(value)}: {feature} is not implemented in zerospeed yet "
        f"(tracked as a later issue); remove the key or set it to {row.default}"
    )


def check_implemented(cfg: ZeroSpeedConfig) -> None:
    """Raise ``ConfigError`` naming every requested feature that zerospeed does not implement yet."""
    lines = [_message(row, _get(cfg, row.key)) for row in ROWS if row.requested(cfg)]
    if lines:
        raise ConfigError("\n".join(lines))
