"""The config features that parse but are refused: not implemented yet, or gone from DeepSpeed itself.

``ROWS`` holds zerospeed's gaps: features DeepSpeed 0.19.8 has and zerospeed does not build yet. Each row
is ``(dotted key, predicate, feature name, value to set instead)``; a row fires when its predicate is
true for the parsed config. When a feature lands, delete its row.

``DEEPSPEED_REFUSED`` holds keys DeepSpeed 0.19.8 refuses itself (features it removed, deepspeedai/
DeepSpeed#8489, or never built): not gaps, never planned. They fail the same way, with a message that
says DeepSpeed refuses them too. (DeepSpeed refuses the removed blocks even when disabled; zerospeed
refuses them only when they switch the feature on.)
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


ROWS: list[Row] = [
    _switch("zero_optimization.offload_optimizer.super_offload", "SuperOffload"),
    Row("aio.use_gds", lambda c: c.aio.use_gds and _uses_nvme(c), "GPUDirect Storage", "false"),
    # (zero_quantized_weights, zero_quantized_gradients, zero_quantized_nontrainable_weights and
    # zero_hpz_partition_size work at stage 3: zero/stage3/zeropp.py, which refuses them at other stages)
    _switch(
        "fp16.fp16_master_weights_and_grads",
        "fp16 master weights and gradients (DeepSpeed 0.19.8 accepts them only at ZeRO stage 1-3 with "
        "offload_optimizer.device=cpu and its compiled DeepSpeedCPUAdam, which keeps fp32 Adam moments over "
        "fp16 masters and fp16 gradient partitions; zerospeed's offloaded step is torch's fused CPU Adam over "
        "fp32 masters, whose moments follow the masters' dtype)",
    ),
    # (data_types.param_dtype / buffer_dtype: runtime/plans.py module_dtypes, DeepSpeed's combinations)
    _switch("optimizer.legacy_fusion", "the legacy fused optimizer"),
    # (disable_allgather: DeepSpeed parses it and never reads it; config/reference.py NO_EFFECT says so)
    # (managed_gradient_accumulation=false: runtime/grad_accumulation.py, Note [caller-managed accumulation])
    # (disable_python_gc, log_level: runtime/process_settings.py)
    # (compression_training: every technique is built, zerospeed/compression; it validates the block)
    # (weight_quantization: weight-only int8 / int4 of linear layers, compression/weight_quant/layer.py)
    # (data_efficiency.data_routing.random_ltd works: data/random_ltd; data_sampling's curriculum sampler
    # and offline analyzer: data/sampler.py, data/analyzer.py)
    # (pipeline.*: the PipelineEngine reads the block, runtime/pipeline.py _apply_pipeline_section)
    _switch("compile.deepcompile", "DeepCompile"),
    Row(
        "checkpoint.writer.type",
        lambda c: c.checkpoint.writer is not None and c.checkpoint.writer.type == "MOCK",
        "the MOCK checkpoint writer (DeepSpeed's I/O benchmark: it writes no data, so nothing could load)",
        '"FAST"',
    ),
]


_REMOVED = "removed from DeepSpeed in 0.19.8 (deepspeedai/DeepSpeed#8489; its config refuses the key too)"

# Checked against DeepSpeed 0.19.8 itself (tests/unit/test_config_features.py lists what its parser says).
DEEPSPEED_REFUSED: list[Row] = [
    _present("zero_optimization.zeropp_loco_param", "LoCo-ZeRO++"),
    _switch("zero_optimization.mics_hierarchical_params_gather", "MiCS hierarchical gather"),
    _switch("amp.enabled", "apex AMP"),
    # (nn.Embedding(sparse=True) gradients need no flag: Note [sparse gradients] in zero/reducer.py)
    _switch("sparse_gradients", "sparse compression of dense embedding gradients"),
    _switch("graph_harvesting", "graph harvesting"),
    _switch("eigenvalue.enabled", "eigenvalue computation"),
    _switch("quantize_training.enabled", "MoQ quantize_training"),
    _switch("nebula.enabled", "Nebula checkpointing"),
    _switch(
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        "random-LTD's layer-token learning-rate schedule",
    ),
]
# what to use instead, where there is something
_INSTEAD = {
    "zero_optimization.zeropp_loco_param": "ZeRO++'s quantized gradients (zero_quantized_gradients) work without it",
    "amp.enabled": "use fp16, bf16 or torch_autocast instead",
    "sparse_gradients": "an nn.Embedding(sparse=True) needs no flag",
}
NEVER_BUILT = {
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled": (
        "never built by DeepSpeed (0.19.8's engine raises ValueError('not yet support') for it)"
    ),
}


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


def refusal_reason(row: Row) -> str:
    """Why DeepSpeed 0.19.8 refuses a ``DEEPSPEED_REFUSED`` key."""
    return NEVER_BUILT.get(row.key, _REMOVED)


def _refused_message(row: Row, value: Any) -> str:
    return (
        f"{row.key}={_render(value)}: {_feature_name(row, value)} was {refusal_reason(row)}, and zerospeed "
        f"does not build it either; remove the key or set it to {row.default}"
        + (f" ({_INSTEAD[row.key]})" if row.key in _INSTEAD else "")
    )


def _feature_name(row: Row, value: Any) -> str:
    return row.feature(value) if callable(row.feature) else row.feature


def check_implemented(cfg: ZeroSpeedConfig) -> None:
    """Raise ``ConfigError`` naming every requested feature that zerospeed does not implement yet, and
    every key DeepSpeed 0.19.8 refuses too."""
    lines = [_message(row, _get(cfg, row.key)) for row in ROWS if row.requested(cfg)]
    lines += [_refused_message(row, _get(cfg, row.key)) for row in DEEPSPEED_REFUSED if row.requested(cfg)]
    if lines:
        raise ConfigError("\n".join(lines))
