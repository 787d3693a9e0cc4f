"""DeepSpeed's ``deepspeed.compression.compress``: ``init_compression``, ``redundancy_clean`` and
``student_initialization``."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from zerospeed.compression.basic_layer import (
    ActivationQuantSpec,
    Conv2dLayer_Compress,
    LinearLayer_Compress,
    PruneSpec,
    QuantizedLinear,
    WeightQuantSpec,
)
from zerospeed.compression.config import ROOT_KEY, CompressionConfig, parse_compression_config
from zerospeed.compression.prune import expand_head_mask
from zerospeed.compression.quantize import quantize_codes
from zerospeed.utils.errors import ConfigError

LINEAR = (nn.Linear, QuantizedLinear)
CONV = (nn.Conv2d,)
# the module types each technique compresses (and that its related_modules may name)
KINDS = {"channel_pruning": CONV}
RELATED_KINDS = {"channel_pruning": (nn.Conv2d, nn.BatchNorm2d)}


def _matches(pattern: str, name: str) -> bool:
    return pattern == "*" or re.search(pattern, name) is not None


def match_modules(model: nn.Module, patterns: list[str], kinds: tuple[type, ...] = LINEAR) -> list[str]:
    """Names of the modules of ``model`` of one of ``kinds`` (Linear, or already compressed, by
    default) matched by any pattern."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, kinds) and name and any(_matches(p, name) for p in patterns)
    ]


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _compressed(model: nn.Module, name: str) -> LinearLayer_Compress | Conv2dLayer_Compress:
    module = model.get_submodule(name)
    if not isinstance(module, (LinearLayer_Compress, Conv2dLayer_Compress)):
        module = Conv2dLayer_Compress(module) if isinstance(module, nn.Conv2d) else LinearLayer_Compress(module)
        _set_module(model, name, module)
    return module


def _refuse_unbuilt(cfg: CompressionConfig) -> None:
    wq, sp = cfg.weight_quantization.shared_parameters, cfg.sparse_pruning.shared_parameters
    if wq.enabled and wq.fp16_mixed_quantize.enabled:
        raise ConfigError(
            f"{ROOT_KEY}.weight_quantization.shared_parameters.fp16_mixed_quantize.enabled: "
            "fp16 mixed quantization is not implemented yet; set it to false"
        )
    if sp.enabled and sp.method == "snip_momentum":
        raise ConfigError(
            f'{ROOT_KEY}.sparse_pruning.shared_parameters.method: "snip_momentum" is not '
            'implemented yet; use "l1" or "topk"'
        )


def _each_group(model: nn.Module, cfg: CompressionConfig, technique: str):
    """Yield (group key, group, module name) for an enabled technique; a module joins one group only."""
    section = getattr(cfg, technique)
    if not section.shared_parameters.enabled:
        return
    seen: set[str] = set()
    for group_name, group in section.different_groups.items():
        key = f"{ROOT_KEY}.{technique}.different_groups.{group_name}"
        kinds = KINDS.get(technique, LINEAR)
        names = [n for n in match_modules(model, group.modules, kinds) if n not in seen]
        if not names:
            what = "nn.Conv2d" if kinds is CONV else "nn.Linear"
            raise ConfigError(f"{key}.modules: {group.modules} match no {what} of the model")
        seen.update(names)
        for name in names:
            yield key, group, name


def init_compression(
    model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None, mpu=None
) -> nn.Module:
    """Swap the configured Linears of ``model`` for ``LinearLayer_Compress`` (in place; returns it).

    With ``layer_reduction.enabled`` and a ``teacher_model``, the student is first initialised from
    the teacher's layers (``student_initialization``).
    """
    if mpu is not None:
        raise ConfigError(
            "init_compression(mpu=...): tensor-parallel compression is not implemented yet; pass mpu=None"
        )
    cfg = parse_compression_config(deepspeed_config)
    _refuse_unbuilt(cfg)
    if cfg.layer_reduction.enabled and teacher_model is not None:
        student_initialization(model, teacher_model, deepspeed_config)
    wq = cfg.weight_quantization.shared_parameters
    for _key, group, name in _each_group(model, cfg, "weight_quantization"):
        layer = _compressed(model, name)
        if layer.out_features % wq.quantize_groups:
            raise ConfigError(
                f"{ROOT_KEY}.weight_quantization.shared_parameters.quantize_groups: "
                f"{wq.quantize_groups} does not divide the {layer.out_features} rows of {name} "
                "(each group must cover whole rows); pick a divisor"
            )
        p = group.params
        layer.enable_weight_quantization(
            WeightQuantSpec(
                p.start_bits,
                p.target_bits,
                p.quantization_period,
                wq.schedule_offset,
                wq.quantize_groups,
                wq.quantization_type == "symmetric",
                wq.rounding == "stochastic",
            )
        )
    aq = cfg.activation_quantization.shared_parameters
    for _key, group, name in _each_group(model, cfg, "activation_quantization"):
        _compressed(model, name).enable_activation_quantization(
            ActivationQuantSpec(
                group.params.bits,
                aq.quantization_type == "symmetric",
                aq.range_calibration == "static",
                aq.schedule_offset,
            )
        )
    for technique, kind in (
        ("sparse_pruning", "sparse"),
        ("row_pruning", "row"),
        ("head_pruning", "head"),
        ("channel_pruning", "channel"),
    ):
        shared = getattr(cfg, technique).shared_parameters
        for key, group, name in _each_group(model, cfg, technique):
            layer = _compressed(model, name)
            spec = PruneSpec(
                shared.method, group.params.dense_ratio, shared.schedule_offset, getattr(shared, "num_heads", None)
            )
            if kind == "head" and layer.in_features % spec.num_heads:
                raise ConfigError(
                    f"{ROOT_KEY}.head_pruning.shared_parameters.num_heads: {spec.num_heads} does not "
                    f"divide the {layer.in_features} input columns of {name}; head pruning applies "
                    "to the attention output projection"
                )
            if kind == "channel" and layer.groups != 1:
                raise ConfigError(
                    f"{key}.modules: {name} is a grouped convolution (groups={layer.groups}); "
                    "channel pruning of grouped convolutions is not implemented"
                )
            layer.enable_pruning(kind, spec)
    return model


# -- redundancy_clean ----------------------------------------------------------------------------
def _with_input_quantization(out: nn.Module, layer: LinearLayer_Compress | Conv2dLayer_Compress) -> nn.Module:
    """``out`` quantizing its input as ``layer`` does now (its static range carried over), if it does."""
    a = layer.act_quant
    if a is None or layer.training_steps < a.offset:
        return out
    if not isinstance(out, QuantizedLinear):
        out = Conv2dLayer_Compress(out) if isinstance(out, nn.Conv2d) else LinearLayer_Compress(out)
    out.enable_activation_quantization(a)
    if a.static:
        out.activation_range.load_state_dict(layer.activation_range.state_dict())
    if not isinstance(out, QuantizedLinear):
        out.set_step(layer.training_steps)
    return out


def _fixed_linear(layer: LinearLayer_Compress) -> nn.Module:
    """The stored form of ``layer`` as it computes now: masks folded in, int8 codes if quantized."""
    with torch.no_grad():
        weight, bias = layer.effective_weight_and_bias()
        q = layer.weight_quant
        if q is None:
            out = nn.Linear(
                layer.in_features,
                layer.out_features,
                bias=bias is not None,
                device=layer.weight.device,
                dtype=layer.weight.dtype,
            )
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
            return _with_input_quantization(out, layer)
        # Note [clean bits]: stored codes use target_bits (DeepSpeed's fix_weight_quantization does
        # too), so the clean model equals the QAT model once its schedule has reached the target.
        c = quantize_codes(layer.weight, q.target_bits, q.groups, q.symmetric)
        rows_per_group = layer.out_features // q.groups
        codes = c.codes.reshape(layer.weight.shape)
        keep = torch.ones_like(codes)
        head = layer.mask("head")
        for m in (
            layer.mask("sparse"),
            layer.mask("row"),
            expand_head_mask(head, layer.in_features) if head is not None else None,
        ):
            if m is not None:
                keep = keep * m.detach()
        zero_O = c.zero.repeat_interleave(rows_per_group).view(-1, 1)
        codes = torch.where(keep > 0, codes, zero_O.expand_as(codes))  # a pruned weight is the value 0
        out = QuantizedLinear(
            codes, c.scale.repeat_interleave(rows_per_group), zero_O.view(-1), bias, q.symmetric, bits=q.target_bits
        )
        return _with_input_quantization(out, layer)


def _fixed_conv(layer: Conv2dLayer_Compress) -> nn.Module:
    with torch.no_grad():
        weight, bias = layer.effective_weight_and_bias()
        out = nn.Conv2d(
            layer.in_channels,
            layer.out_channels,
            layer.kernel_size,
            stride=layer.stride,
            padding=layer.padding,
            dilation=layer.dilation,
            groups=layer.groups,
            bias=bias is not None,
            padding_mode=layer.padding_mode,
            device=layer.weight.device,
            dtype=layer.weight.dtype,
        )
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return _with_input_quantization(out, layer)


def _keep(module: nn.Module, idx: torch.Tensor, dim: int) -> None:
    """Keep only entries ``idx`` of ``module``'s outputs (``dim`` 0: rows / output channels, with the
    bias) or inputs (``dim`` 1: columns / input channels); a BatchNorm keeps those channels."""
    if isinstance(module, QuantizedLinear):
        module.keep_rows(idx) if dim == 0 else module.keep_cols(idx)
        return
    if isinstance(module, nn.BatchNorm2d):
        for name in ("weight", "bias"):
            if getattr(module, name) is not None:
                setattr(module, name, nn.Parameter(getattr(module, name).detach()[idx].clone()))
        for name in ("running_mean", "running_var"):
            if getattr(module, name) is not None:
                setattr(module, name, getattr(module, name)[idx].clone())
        module.num_features = len(idx)
        return
    module.weight = nn.Parameter(module.weight.detach().index_select(dim, idx).clone())
    if dim == 0 and module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach()[idx].clone())
    size = {
        (nn.Conv2d, 0): "out_channels",
        (nn.Conv2d, 1): "in_channels",
        (nn.Linear, 0): "out_features",
        (nn.Linear, 1): "in_features",
    }
    kind = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Linear
    setattr(module, size[(kind, dim)], len(idx))


def _size(module: nn.Module, dim: int) -> int:
    if isinstance(module, nn.BatchNorm2d):
        return module.num_features
    if isinstance(module, QuantizedLinear):
        return module.in_features if dim else module.out_features
    return module.weight.shape[dim]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _related(
    model: nn.Module, name: str, group, pattern_index: int, key: str, kinds: tuple[type, ...] = LINEAR
) -> list[str]:
    """The modules that follow ``name``'s pruned entries: per related pattern, the matching module
    nearest to ``name`` in the module tree (longest common dotted prefix, which must be unique)."""
    patterns = group.related_modules or []
    if pattern_index >= len(patterns):
        return []
    found = []
    for pattern in patterns[pattern_index]:
        candidates = [n for n in match_modules(model, [pattern], kinds) if n != name]
        if not candidates:
            raise ConfigError(
                f"{key}.related_modules: {pattern!r} matches no "
                f"{' / '.join('nn.' + k.__name__ for k in kinds[:2])} of the model"
            )
        best = max(_common_prefix(n, name) for n in candidates)
        nearest = [n for n in candidates if _common_prefix(n, name) == best]
        if len(nearest) > 1:
            raise ConfigError(
                f"{key}.related_modules: {pattern!r} matches {nearest}, all equally near to {name}; "
                "make the pattern specific"
            )
        found.append(nearest[0])
    return found


def _shared_weights(model: nn.Module) -> set[int]:
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {pid for pid, n in counts.items() if n > 1}


# Note [structured removal]: what redundancy_clean removes for each structured mask — entries of the
# pruned module along one dimension and of each related module along the other:
#   row:     the Linear's output rows (and bias); the next Linear's input columns.
#   head:    the output projection's input columns of the pruned heads; the same rows of q / k / v.
#   channel: the Conv2d's output channels (and bias); the next Conv2d's input channels, a BatchNorm's
#            channels.
# (mask kind, technique, dimension on the pruned module, on its related modules)
STRUCTURED = (("row", "row_pruning", 0, 1), ("head", "head_pruning", 1, 0), ("channel", "channel_pruning", 0, 1))


def _kept(layer, kind: str, mask: torch.Tensor) -> torch.Tensor:
    if kind == "head":
        mask = expand_head_mask(mask, layer.in_features)
    return torch.nonzero(mask.detach().view(-1) > 0).view(-1)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu=None) -> nn.Module:
    """Make the compression real (in place; returns ``model``).

    Every ``LinearLayer_Compress`` becomes a plain ``nn.Linear`` (masks folded in) or, when weight
    quantization is configured, a ``QuantizedLinear`` holding 8- or 4-bit codes; every
    ``Conv2dLayer_Compress`` a plain ``nn.Conv2d``. A layer that quantizes its input stays a
    compressed layer that does only that. Pruned rows, heads and channels are removed, with the
    matching entries of the ``related_modules`` (Note [structured removal]).
    """
    cfg = parse_compression_config(deepspeed_config)
    shared = _shared_weights(model)
    removals: list[tuple[str, str, int, int, int, torch.Tensor]] = []
    compressed = [
        (n, m) for n, m in model.named_modules() if isinstance(m, (LinearLayer_Compress, Conv2dLayer_Compress))
    ]
    for name, layer in compressed:
        for kind, technique, own_dim, related_dim in STRUCTURED:
            mask = layer.mask(kind)
            if mask is None:
                continue
            if id(layer.weight) in shared:
                raise ConfigError(
                    f"{ROOT_KEY}.{technique}: {name}'s weight is shared with another module (tied); "
                    f"its {kind}s cannot be removed — exclude it from {technique} modules"
                )
            removals.append(
                (name, technique, own_dim, related_dim, layer.weight.shape[own_dim], _kept(layer, kind, mask))
            )
        _set_module(model, name, _fixed_conv(layer) if isinstance(layer, nn.Conv2d) else _fixed_linear(layer))
    for name, technique, own_dim, related_dim, full, idx in removals:
        _keep(model.get_submodule(name), idx, own_dim)
        for group_name, group in getattr(cfg, technique).different_groups.items():
            key = f"{ROOT_KEY}.{technique}.different_groups.{group_name}"
            for i, pattern in enumerate(group.modules):
                if _matches(pattern, name):
                    for other in _related(model, name, group, i, key, RELATED_KINDS.get(technique, LINEAR)):
                        module = model.get_submodule(other)
                        if _size(module, related_dim) != full:
                            raise ConfigError(
                                f"{key}.related_modules: {other} has {_size(module, related_dim)} "
                                f"{'inputs' if related_dim else 'outputs'} where {name} had {full} "
                                f"{'outputs' if own_dim == 0 else 'inputs'}; it cannot follow {name}'s pruning"
                            )
                        _keep(module, idx, related_dim)
    return model


# -- layer reduction -----------------------------------------------------------------------------
def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any) -> None:
    """Copy teacher layers ``teacher_layer[i]`` into student layer ``i`` under ``module_name_prefix``,
    and the modules of ``other_module_name`` as they are (DeepSpeed's layer-reduction initialisation)."""
    lr = parse_compression_config(deepspeed_config).layer_reduction
    key = f"{ROOT_KEY}.layer_reduction"
    if not lr.module_name_prefix or not lr.teacher_layer:
        raise ConfigError(f"{key}: module_name_prefix and teacher_layer are needed to initialise a student")
    if lr.keep_number_layer is not None and lr.keep_number_layer != len(lr.teacher_layer):
        raise ConfigError(
            f"{key}.keep_number_layer: {lr.keep_number_layer} != len(teacher_layer) "
            f"({len(lr.teacher_layer)}); make them agree"
        )
    pairs = [(f"{lr.module_name_prefix}.{i}", f"{lr.module_name_prefix}.{t}") for i, t in enumerate(lr.teacher_layer)]
    pairs += [(n, n) for n in lr.other_module_name]
    for student_name, teacher_name in pairs:
        try:
            src, dst = teacher_model.get_submodule(teacher_name), student_model.get_submodule(student_name)
        except AttributeError as exc:
            raise ConfigError(f"{key}: {exc}; check module_name_prefix / teacher_layer / other_module_name") from None
        dst.load_state_dict(src.state_dict())
