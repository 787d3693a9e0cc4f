"""Compressed model files: ``save_compressed`` writes a cleaned model (``redundancy_clean``) as one
safetensors file whose header records every module that compression changed; ``load_compressed``
rebuilds a working model from it and the *uncompressed* architecture (build the model as usual and
pass it in; its weights are overwritten).

The file holds the codes, scales and pruned weights as they are: an int8 layer is ~4x smaller than
fp32 on disk, a packed int4 one ~8x, ternary ~16x, binary ~32x, a pruned one by the removed fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from zerospeed.compression.basic_layer import (
    ActivationQuantSpec,
    Conv2dLayer_Compress,
    LinearLayer_Compress,
    QuantizedLinear,
)
from zerospeed.utils.files import atomic_write_named

META_KEY = "zerospeed.compression"
FORMAT = 1


def _act(module) -> dict | None:
    a = getattr(module, "act_quant", None)
    return None if a is None else {"bits": a.bits, "symmetric": a.symmetric, "static": a.static, "offset": a.offset}


def _describe(module: nn.Module) -> dict | None:
    """What ``load_compressed`` needs to rebuild ``module`` before loading its tensors."""
    if isinstance(module, QuantizedLinear):
        return {
            "kind": "QuantizedLinear",
            "in": module.in_features,
            "out": module.out_features,
            "bits": module.width,
            "symmetric": module.symmetric,  # (3 bits are stored as 4)
            "bias": module.bias is not None,
            "act": _act(module),
        }
    if isinstance(module, nn.Linear):
        return {
            "kind": "Linear",
            "in": module.in_features,
            "out": module.out_features,
            "bias": module.bias is not None,
            "act": _act(module),
        }
    if isinstance(module, nn.Conv2d):
        return {"kind": "Conv2d", "in": module.in_channels, "out": module.out_channels, "act": _act(module)}
    if isinstance(module, nn.BatchNorm2d):
        return {"kind": "BatchNorm2d", "features": module.num_features}
    return None


def save_compressed(model: nn.Module, path: str | Path) -> int:
    """Write ``model`` (after ``redundancy_clean``) to ``path`` atomically; returns the file's bytes."""
    if any(isinstance(m, (LinearLayer_Compress, Conv2dLayer_Compress)) and m.specs for m in model.modules()):
        raise ValueError(
            "save_compressed: the model still holds masks in training form; call redundancy_clean(model, config) first"
        )
    from safetensors.torch import save_model

    modules = {name: d for name, m in model.named_modules() if name and (d := _describe(m)) is not None}
    metadata = {META_KEY: json.dumps({"format": FORMAT, "modules": modules})}
    atomic_write_named(Path(path), lambda tmp: save_model(model, str(tmp), metadata=metadata))
    return Path(path).stat().st_size


def _rebuild(old: nn.Module, d: dict) -> nn.Module:
    like = {"dtype": torch.float32}
    if d["kind"] == "QuantizedLinear":
        codes = torch.zeros(d["out"], d["in"], dtype=torch.int16)
        zero = torch.zeros(d["out"])
        new = QuantizedLinear(
            codes,
            torch.ones(d["out"]),
            zero,
            torch.zeros(d["out"]) if d["bias"] else None,
            d["symmetric"],
            bits=d["bits"],
        )
    elif d["kind"] == "Linear":
        new = nn.Linear(d["in"], d["out"], bias=d["bias"], **like)
    elif d["kind"] == "Conv2d":
        new = nn.Conv2d(
            d["in"],
            d["out"],
            old.kernel_size,
            stride=old.stride,
            padding=old.padding,
            dilation=old.dilation,
            groups=old.groups,
            bias=old.bias is not None,
            padding_mode=old.padding_mode,
            **like,
        )
    else:
        new = nn.BatchNorm2d(
            d["features"],
            eps=old.eps,
            momentum=old.momentum,
            affine=old.affine,
            track_running_stats=old.track_running_stats,
            **like,
        )
    act = d.get("act")
    if act is not None:
        spec = ActivationQuantSpec(act["bits"], act["symmetric"], act["static"], act["offset"])
        if not isinstance(new, QuantizedLinear):
            new = Conv2dLayer_Compress(new) if isinstance(new, nn.Conv2d) else LinearLayer_Compress(new)
            new.set_step(act["offset"])
        new.enable_activation_quantization(spec)
    return new


def load_compressed(model: nn.Module, path: str | Path) -> nn.Module:
    """Turn ``model`` (the uncompressed architecture, built as usual) into the compressed model saved
    at ``path`` (in place; returns it in eval mode). Tied weights stay tied where both users survive."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    with safe_open(str(path), framework="pt") as f:
        header = (f.metadata() or {}).get(META_KEY)
    if header is None:
        raise ValueError(
            f"{path}: not a zerospeed compressed model file (no {META_KEY!r} metadata); "
            "write it with zerospeed.compression.save_compressed"
        )
    info = json.loads(header)
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: compressed-model format {info.get('format')} (this zerospeed reads {FORMAT})")
    tied = _tied_names(model)
    for name, d in info["modules"].items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, _rebuild(owner.get_submodule(child), d))
    _retie(model, tied)
    load_model(model, str(path), strict=True)
    return model.eval()


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter (weight tying)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Re-tie what rebuilding untied (a rebuilt module has fresh parameters); a user that became a
    QuantizedLinear has no weight Parameter left and drops out of its group."""
    present = dict(model.named_parameters(remove_duplicate=False))
    for names in groups:
        names = [n for n in names if n in present]
        for other in names[1:]:
            parent, _, leaf = other.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, present[names[0]])
