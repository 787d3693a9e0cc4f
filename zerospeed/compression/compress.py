"""DeepSpeed's ``deepspeed.compression.compress``: ``init_compression``, ``redundancy_clean`` and
``student_initialization``."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from zerospeed.compression.basic_layer import LinearLayer_Compress, PruneSpec, QuantizedLinear, WeightQuantSpec
from zerospeed.compression.config import ROOT_KEY, CompressionConfig, parse_compression_config
from zerospeed.compression.quantize import quantize_codes
from zerospeed.config.errors import ConfigError

NOT_IMPLEMENTED = ("activation_quantization", "head_pruning", "channel_pruning")


def _matches(pattern: str, name: str) -> bool:
    return pattern == "*" or re.search(pattern, name) is not None


def match_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """Names of the Linear (or already compressed) modules of ``model`` matched by any pattern."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, QuantizedLinear)) and name and any(_matches(p, name) for p in patterns)]


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _compressed(model: nn.Module, name: str) -> LinearLayer_Compress:
    module = model.get_submodule(name)
    if not isinstance(module, LinearLayer_Compress):
        module = LinearLayer_Compress(module)
        _set_module(model, name, module)
    return module


def _refuse_unbuilt(cfg: CompressionConfig) -> None:
    for name in NOT_IMPLEMENTED:
        if getattr(cfg, name).shared_parameters.enabled:
            raise ConfigError(f"{ROOT_KEY}.{name}.shared_parameters.enabled: {name} is not implemented yet "
                              "(see docs/compression.md); set it to false")
    wq, sp = cfg.weight_quantization.shared_parameters, cfg.sparse_pruning.shared_parameters
    if wq.enabled and wq.fp16_mixed_quantize.enabled:
        raise ConfigError(f"{ROOT_KEY}.weight_quantization.shared_parameters.fp16_mixed_quantize.enabled: "
                          "fp16 mixed quantization is not implemented yet; set it to false")
    if sp.enabled and sp.method == "snip_momentum":
        raise ConfigError(f"{ROOT_KEY}.sparse_pruning.shared_parameters.method: \"snip_momentum\" is not "
                          "implemented yet; use \"l1\" or \"topk\"")


def _each_group(model: nn.Module, cfg: CompressionConfig, technique: str):
    """Yield (group key, group, module name) for an enabled technique; a module joins one group only."""
    section = getattr(cfg, technique)
    if not section.shared_parameters.enabled:
        return
    seen: set[str] = set()
    for group_name, group in section.different_groups.items():
        key = f"{ROOT_KEY}.{technique}.different_groups.{group_name}"
        names = [n for n in match_modules(model, group.modules) if n not in seen]
        if not names:
            raise ConfigError(f"{key}.modules: {group.modules} match no nn.Linear of the model")
        seen.update(names)
        for name in names:
            yield key, group, name


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu=None) -> nn.Module:
    """Swap the configured Linears of ``model`` for ``LinearLayer_Compress`` (in place; returns it).

    With ``layer_reduction.enabled`` and a ``teacher_model``, the student is first initialised from
    the teacher's layers (``student_initialization``).
    """
    if mpu is not None:
        raise ConfigError("init_compression(mpu=...): tensor-parallel compression is not implemented yet; "
                          "pass mpu=None")
    cfg = parse_compression_config(deepspeed_config)
    _refuse_unbuilt(cfg)
    if cfg.layer_reduction.enabled and teacher_model is not None:
        student_initialization(model, teacher_model, deepspeed_config)
    wq = cfg.weight_quantization.shared_parameters
    for key, group, name in _each_group(model, cfg, "weight_quantization"):
        layer = _compressed(model, name)
        if layer.out_features % wq.quantize_groups:
            raise ConfigError(f"{ROOT_KEY}.weight_quantization.shared_parameters.quantize_groups: "
                              f"{wq.quantize_groups} does not divide the {layer.out_features} rows of {name} "
                              "(each group must cover whole rows); pick a divisor")
        p = group.params
        layer.enable_weight_quantization(WeightQuantSpec(
            p.start_bits, p.target_bits, p.quantization_period, wq.schedule_offset, wq.quantize_groups,
            wq.quantization_type == "symmetric", wq.rounding == "stochastic"))
    for technique, enable in (("sparse_pruning", "enable_sparse_pruning"), ("row_pruning", "enable_row_pruning")):
        shared = getattr(cfg, technique).shared_parameters
        for key, group, name in _each_group(model, cfg, technique):
            layer = _compressed(model, name)
            getattr(layer, enable)(PruneSpec(shared.method, group.params.dense_ratio, shared.schedule_offset))
    return model


# -- redundancy_clean ----------------------------------------------------------------------------
def _fixed_linear(layer: LinearLayer_Compress) -> nn.Module:
    """The stored form of ``layer`` as it computes now: masks folded in, int8 codes if quantized."""
    with torch.no_grad():
        sparse = layer.mask("sparse")
        row = layer.mask("row")
        bias = layer.bias.detach() * row.view(-1) if (row is not None and layer.bias is not None) else layer.bias
        q = layer.weight_quant
        if q is None:
            out = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None,
                            device=layer.weight.device, dtype=layer.weight.dtype)
            weight, _ = layer.effective_weight_and_bias()
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
            return out
        # Note [clean bits]: stored codes use target_bits (DeepSpeed's fix_weight_quantization does
        # too), so the clean model equals the QAT model once its schedule has reached the target.
        c = quantize_codes(layer.weight, q.target_bits, q.groups, q.symmetric)
        rows_per_group = layer.out_features // q.groups
        codes = c.codes.reshape(layer.weight.shape)
        keep = torch.ones_like(codes)
        for m in (sparse, row):
            if m is not None:
                keep = keep * m.detach()
        zero_O = c.zero.repeat_interleave(rows_per_group).view(-1, 1)
        codes = torch.where(keep > 0, codes, zero_O.expand_as(codes))  # a pruned weight is the value 0
        return QuantizedLinear(codes, c.scale.repeat_interleave(rows_per_group), zero_O.view(-1), bias,
                               q.symmetric, bits=q.target_bits)


def _keep_rows(module: nn.Module, idx: torch.Tensor) -> None:
    if isinstance(module, QuantizedLinear):
        module.keep_rows(idx)
        return
    module.weight = nn.Parameter(module.weight.detach()[idx].clone())
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach()[idx].clone())
    module.out_features = len(idx)


def _keep_cols(module: nn.Module, idx: torch.Tensor) -> None:
    if isinstance(module, QuantizedLinear):
        module.keep_cols(idx)
        return
    module.weight = nn.Parameter(module.weight.detach()[:, idx].clone())
    module.in_features = len(idx)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _related(model: nn.Module, name: str, group, pattern_index: int, key: str) -> list[str]:
    """The modules whose input columns follow ``name``'s rows: per related pattern, the matching
    Linear nearest to ``name`` in the module tree (longest common dotted prefix, which must be unique)."""
    patterns = (group.related_modules or [])
    if pattern_index >= len(patterns):
        return []
    found = []
    for pattern in patterns[pattern_index]:
        candidates = [n for n in match_modules(model, [pattern]) if n != name]
        if not candidates:
            raise ConfigError(f"{key}.related_modules: {pattern!r} matches no nn.Linear of the model")
        best = max(_common_prefix(n, name) for n in candidates)
        nearest = [n for n in candidates if _common_prefix(n, name) == best]
        if len(nearest) > 1:
            raise ConfigError(f"{key}.related_modules: {pattern!r} matches {nearest}, all equally near to {name}; "
                              "make the pattern specific")
        found.append(nearest[0])
    return found


def _shared_weights(model: nn.Module) -> set[int]:
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {pid for pid, n in counts.items() if n > 1}


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu=None) -> nn.Module:
    """Make the compression real (in place; returns ``model``).

    Every ``LinearLayer_Compress`` becomes a plain ``nn.Linear`` (masks folded in) or, when weight
    quantization is configured, a ``QuantizedLinear`` holding 8-bit codes; row-pruned rows are
    removed, and with ``related_modules`` so are the matching input columns of the next Linear.
    """
    cfg = parse_compression_config(deepspeed_config)
    shared = _shared_weights(model)
    pruned: list[tuple[str, torch.Tensor]] = []
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, LinearLayer_Compress)]:
        row = layer.mask("row")
        if row is not None and id(layer.weight) in shared:
            raise ConfigError(f"{ROOT_KEY}.row_pruning: {name}'s weight is shared with another module (tied); "
                              "its rows cannot be removed — exclude it from row_pruning modules")
        if row is not None:
            pruned.append((name, torch.nonzero(row.detach().view(-1) > 0).view(-1)))
        _set_module(model, name, _fixed_linear(layer))
    groups = cfg.row_pruning.different_groups
    for name, idx in pruned:
        _keep_rows(model.get_submodule(name), idx)
        for group_name, group in groups.items():
            for i, pattern in enumerate(group.modules):
                if pattern == "*" or re.search(pattern, name):
                    key = f"{ROOT_KEY}.row_pruning.different_groups.{group_name}"
                    for other in _related(model, name, group, i, key):
                        _keep_cols(model.get_submodule(other), idx)
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
        raise ConfigError(f"{key}.keep_number_layer: {lr.keep_number_layer} != len(teacher_layer) "
                          f"({len(lr.teacher_layer)}); make them agree")
    pairs = [(f"{lr.module_name_prefix}.{i}", f"{lr.module_name_prefix}.{t}") for i, t in enumerate(lr.teacher_layer)]
    pairs += [(n, n) for n in lr.other_module_name]
    for student_name, teacher_name in pairs:
        try:
            src, dst = teacher_model.get_submodule(teacher_name), student_model.get_submodule(student_name)
        except AttributeError as exc:
            raise ConfigError(f"{key}: {exc}; check module_name_prefix / teacher_layer / other_module_name") from None
        dst.load_state_dict(src.state_dict())
