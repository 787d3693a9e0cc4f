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
    # (zero_quantized_weights, zero_quantized_gradients, zero_quantized_nontrainable_weights and
    # zero_hpz_partition_size work at stage 3: zero/stage3/zeropp.py, which refuses them at other stages)
    _present("zero_optimization.zeropp_loco_param", "LoCo-ZeRO++" + _GONE),
    _switch("zero_optimization.mics_hierarchical_params_gather", "MiCS hierarchical gather" + _GONE),
    _switch("amp.enabled", "apex AMP" + _GONE),
    _switch(
        "fp16.fp16_master_weights_and_grads",
        "fp16 master weights and gradients (DeepSpeed builds them only on ZeRO-Offload with its compiled "
        "CPU Adam writing fp16 masters; zerospeed's offloaded step keeps fp32 masters)",
    ),
    # (data_types.param_dtype / buffer_dtype: runtime/plans.py module_dtypes, DeepSpeed's combinations)
    _switch("optimizer.legacy_fusion", "the legacy fused optimizer"),
    # (nn.Embedding(sparse=True) gradients need no flag: Note [sparse gradients] in zero/reducer.py)
    _switch("sparse_gradients", "sparse compression of dense embedding gradients" + _GONE),
    # (disable_allgather: DeepSpeed parses it and never reads it; config/reference.py NO_EFFECT says so)
    _switch("graph_harvesting", "graph harvesting" + _GONE),
    Row(
        "managed_gradient_accumulation",
        lambda c: not c.managed_gradient_accumulation,
        "caller-managed gradient accumulation",
        "true",
    ),
    # (disable_python_gc, log_level: runtime/process_settings.py)
    # (compression_training: every technique is built, zerospeed/compression; it validates the block)
    # (weight_quantization: weight-only int8 / int4 of linear layers, compression/weight_quant/layer.py)
    # (data_efficiency.data_routing.random_ltd works: data/random_ltd; data_sampling's curriculum sampler
    # and offline analyzer: data/sampler.py, data/analyzer.py)
    _switch(
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        "random-LTD's layer-token learning-rate schedule (DeepSpeed refuses it too)",
    ),
    _switch("eigenvalue.enabled", "eigenvalue computation" + _GONE),
    _switch("quantize_training.enabled", "MoQ quantize_training" + _GONE),
    # (pipeline.*: the PipelineEngine reads the block, runtime/pipeline.py _apply_pipeline_section)
    _switch("compile.deepcompile", "DeepCompile"),
    _switch("nebula.enabled", "Nebula checkpointing" + _GONE),
    Row(
        "checkpoint.writer.type",
        lambda c: c.checkpoint.writer is not None and c.checkpoint.writer.type == "MOCK",
        "the MOCK checkpoint writer (DeepSpeed's I/O benchmark: it writes no data, so nothing could load)",
        '"FAST"',
    ),
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
