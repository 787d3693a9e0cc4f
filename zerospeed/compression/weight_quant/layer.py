"""`QuantizedLinear`: a linear layer whose weight is stored int8 / int4 group-wise (groupwise.py) and
dequantized for each forward (weight-only quantization: activations stay in the model's dtype).

`quantize_model(model, settings_for)` replaces every nn.Linear (and transformers Conv1D, transposed to
[out, in]) that `settings_for(name)` returns settings for, except a head tied to the input embedding
(its weight is the embedding's too). DeepSpeed's config form is `quant.weight.post_init_quant`:
{"name substring": {"num_bits": 4, "group_size": 64, "symmetric": false}}, or
`quant.weight.quantized_initialization`: one such settings object for every linear layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.compression.weight_quant.groupwise import QuantizedWeight, dequantize, quantize
from zerospeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from zerospeed.utils.errors import ConfigError


class QuantizedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, bits: int, group_size: int, symmetric: bool):
        super().__init__()
        qw = quantize(weight, bits, group_size, symmetric)
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size = bits, group_size
        self.register_buffer("qdata", qw.data)
        self.register_buffer("scale", qw.scale)
        self.register_buffer("minimum", qw.minimum)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(
            self.qdata, self.scale, self.minimum, (self.out_features, self.in_features), self.bits, self.group_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.quantized(), x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, group {self.group_size}"
        )


class QuantizedTensorParallel:
    """Mixed into a tensor-parallel linear's class (Note [quantized tensor-parallel layers])."""

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qdata, self.scale, self.minimum, self.local_shape, self.bits, self.group_size)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.quantized(), self.scale.dtype)


_TP_CLASSES: dict[type, type] = {}


def _quantize_tensor_parallel(module: nn.Module, bits: int, group_size: int, symmetric: bool) -> nn.Module:
    """`module` (a tensor-parallel linear) with its local weight quantized, in place."""
    qw = quantize(module.weight.detach(), bits, group_size, symmetric)
    del module._parameters["weight"]
    module.register_buffer("qdata", qw.data)
    module.register_buffer("scale", qw.scale)
    module.register_buffer("minimum", qw.minimum)
    module.local_shape, module.bits, module.group_size = qw.shape, bits, group_size
    cls = type(module)
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"Quantized{cls.__name__}", (QuantizedTensorParallel, cls), {})
    module.__class__ = _TP_CLASSES[cls]
    return module


def _is_tensor_parallel_linear(module: nn.Module) -> bool:
    return (
        isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        and not isinstance(module, QuantizedTensorParallel)
        and isinstance(module._parameters.get("weight"), torch.Tensor)
    )


def _as_linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers GPT-2: weight [in, out]
        return module.weight.t(), module.bias
    return None


def settings_from_config(weight_config) -> Callable[[str], dict | None]:
    """Which settings apply to a layer name under DeepSpeed's `quant.weight` section."""
    patterns: dict[str, Any] = dict(weight_config.post_init_quant or {})
    everywhere = dict(weight_config.quantized_initialization or {})

    def settings_for(name: str) -> dict | None:
        matched = [p for p in patterns if p in name]
        if len(matched) > 1:
            raise ValueError(
                f"quant.weight.post_init_quant: layer {name!r} matches several keys {matched}; make them distinct"
            )
        return patterns[matched[0]] if matched else (everywhere or None)

    return settings_for


def _checked(name: str, settings: dict) -> tuple[int, int, bool]:
    """(num_bits, group_size, symmetric) of one layer's settings; unknown keys are an error."""
    unknown = set(settings) - {"num_bits", "group_size", "group_dim", "symmetric"}
    if unknown or settings.get("group_dim", 1) != 1:
        raise ValueError(
            f"quantization settings for {name!r}: {sorted(unknown) or 'group_dim must be 1'}; "
            "known keys: num_bits, group_size, group_dim (1: groups along the input features), "
            "symmetric"
        )
    bits, group_size = int(settings.get("num_bits", 8)), int(settings.get("group_size", 64))
    if bits not in (4, 8) or group_size < 1:
        raise ValueError(
            f"quantization settings for {name!r}: num_bits = {bits}, group_size = {group_size}; "
            "weight-only quantization supports num_bits 4 and 8 and a positive group_size"
        )
    return bits, group_size, bool(settings.get("symmetric", False))


def stage3_settings(settings_for: Callable[[str], dict | None]) -> Callable[[str, nn.Module], tuple | None]:
    """ZeRO-Inference (Note [quantized ZeRO-Inference shards], inference/zero.py): for a linear layer the
    (bits, block, symmetric) its stored shard is block-quantized with — `group_size` consecutive elements
    per scale — or None."""

    def settings(name: str, module: nn.Module) -> tuple | None:
        found = settings_for(name) if _as_linear(module) is not None else None
        return _checked(name, found) if found else None

    return settings


def quantize_model(model: nn.Module, settings_for: Callable[[str], dict | None]) -> dict[str, int]:
    """Replace matching linear layers in place; returns {layer name: bits}."""
    tied = None
    if hasattr(model, "get_output_embeddings") and hasattr(model, "get_input_embeddings"):
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0):
            tied = head
    done = {}
    for name, module in list(model.named_modules()):
        parallel = _is_tensor_parallel_linear(module)
        found = _as_linear(module) if not parallel else (module.weight, module.bias)
        settings = settings_for(name) if found is not None and module is not tied else None
        if not settings:
            continue
        bits, group_size, symmetric = _checked(name, settings)
        weight, bias = found
        if parallel:  # Note [quantized tensor-parallel layers]
            try:
                _quantize_tensor_parallel(module, bits, group_size, symmetric)
            except ValueError as exc:
                raise ValueError(f"layer {name!r} (this rank's tensor-parallel slice): {exc}") from None
            done[name] = module.bits
            continue
        new = QuantizedLinear(weight, bias, bits=bits, group_size=group_size, symmetric=symmetric)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        done[name] = new.bits
    return done


def apply_weight_quantization_config(model: nn.Module, cfg) -> Callable | None:
    """The training config's top-level `weight_quantization` (DeepSpeed's ZeRO-Inference route:
    `initialize(model, config={..., "weight_quantization": {"quantized_initialization": {...}}})`), before
    the engine partitions the model. Below stage 3 the selected linear layers become `QuantizedLinear`
    (frozen, as in init_inference). At stage 3 they are frozen, so that the engine partitions them as
    frozen units, and the returned settings quantize their stored shards once it has (Note [quantized
    ZeRO-Inference shards], inference/zero.py); None when there is nothing more to do."""
    wq = cfg.weight_quantization
    if wq is None or not wq.enabled or not (wq.post_init_quant or wq.quantized_initialization):
        return None
    settings_for = settings_from_config(wq)
    try:
        if cfg.zero_optimization.stage != 3:
            quantize_model(model, settings_for)
            return None
        settings = stage3_settings(settings_for)
        for name, module in model.named_modules():
            if settings(name, module):
                module.requires_grad_(False)
    except ValueError as exc:
        raise ConfigError(f"weight_quantization: {exc}") from None
    return settings
