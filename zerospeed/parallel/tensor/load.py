"""Shard-on-load: fill a model built on the meta device with this rank's slices, read straight from
safetensors files, so no rank ever holds the whole model. Shared by training
(`tp_model_init(model, tp, checkpoint=...)`) and inference (`init_inference(model, checkpoint=...)`).

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))   # no memory
    tp_model_init(model, tp_size=2, checkpoint=path)

AutoTP shards the meta model first (layouts only: every shard is a meta tensor), then each parameter
gets real storage of its local shape and is filled by reading, from the file that holds it, only the
segments its `ShardSpec` names (safetensors reads a slice without loading the tensor). Peak host memory
is this rank's shards plus one tensor piece in flight.

Note [ties survive materialisation]: `Module.to_empty` makes a new tensor per registration, which would
untie a head sharing the embedding's weight. Parameters are replaced here one distinct object at a
time (a memo by identity), so every module that shared a parameter still shares it — and each new
parameter is an ordinary leaf keeping the meta one's `requires_grad`, ready for an optimizer.

Note [buffers that are not in checkpoints]: non-persistent buffers (rotary `inv_freq`) are computed at
construction — on the meta device they are empty shells. transformers recomputes them itself when it
loads a model built on meta, through the model's `_init_weights(module)`; the loader calls that for the
modules holding such buffers (and only for them) before loading parameters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zerospeed.parallel.tensor.partition import ShardSpec
from zerospeed.utils.errors import ConfigError

_INDEX_SUFFIX = ".safetensors.index.json"


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def safetensors_files(checkpoint: Any) -> list[str]:
    """The safetensors files of `checkpoint`: a `save_pretrained` directory (the files its
    `*.safetensors.index.json` names when it has one, else every `.safetensors` file), an index file, a
    `.safetensors` file, or a list of files."""
    if isinstance(checkpoint, (list, tuple)):
        if not checkpoint:
            raise ConfigError("checkpoint: an empty list of files")
        return [f for item in checkpoint for f in safetensors_files(item)]
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(_INDEX_SUFFIX))
        if len(indexes) == 1:
            return safetensors_files(os.path.join(path, indexes[0]))
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise ConfigError(
                f"checkpoint: directory {path!r} has no .safetensors files (save it with "
                "save_pretrained(..., safe_serialization=True), or convert its .bin files)"
            )
        return [os.path.join(path, f) for f in found]
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint: {path!r} does not exist")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f'checkpoint: {path!r} has no "weight_map"; is it a safetensors index?')
        base = os.path.dirname(path)
        return [os.path.join(base, name) for name in sorted(set(weight_map.values()))]
    return [path]


def _index(files: Iterable[str]) -> dict[str, str]:
    """{tensor name: the safetensors file holding it} (from the files' headers; no tensor is read)."""
    from safetensors import safe_open

    files = list(files)
    bad = [f for f in files if not f.endswith(".safetensors")]
    if bad:
        raise ConfigError(
            f"checkpoint: loading into a meta-device model reads .safetensors files only; got {bad[:3]} "
            "(convert them, or build the model on the CPU)"
        )
    index = {}
    for path in files:
        if not os.path.exists(path):
            raise ConfigError(f"checkpoint: {path!r} does not exist")
        with safe_open(path, framework="pt") as f:
            index.update({name: path for name in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return index


def _read(path: str, name: str, spec: ShardSpec | None, transposed: bool) -> torch.Tensor:
    """This rank's piece of tensor `name`: only `spec`'s segments are read (all of it when None)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        if spec is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        rank = len(sl.get_shape())
        dim = 1 - spec.dim if transposed and rank == 2 else spec.dim  # a Conv1D is stored [in, out]
        parts = []
        for start, n in spec.segments:
            index = [slice(None)] * rank
            index[dim] = slice(start, start + n)
            parts.append(sl[tuple(index)])
        piece = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        return piece.t() if transposed and rank == 2 else piece


def _materialise(model: nn.Module) -> list[nn.Module]:
    """Real (uninitialised) CPU storage for every meta parameter and buffer (Note [ties survive
    materialisation]); returns the modules whose buffers no checkpoint holds."""
    memo: dict[int, nn.Parameter] = {}
    needs_init = []
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                setattr(module, name, memo[id(p)])
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        for name in meta_buffers:
            setattr(module, name, torch.empty_like(getattr(module, name), device="cpu"))
        if any(n in getattr(module, "_non_persistent_buffers_set", ()) for n in meta_buffers):
            needs_init.append(module)
    return needs_init


def load_shards(model: nn.Module, files: Iterable[str]) -> None:
    """Fill the (AutoTP-sharded or whole) meta `model` from safetensors `files`, reading only local slices."""
    index = _index(os.fspath(f) for f in files)
    computed = _materialise(model)
    if computed and not hasattr(model, "_init_weights"):
        raise ConfigError(
            f"checkpoint: {type(model).__name__} built on the meta device has buffers no checkpoint "
            "holds and no transformers _init_weights to compute them; build it on the CPU instead"
        )
    with torch.no_grad():
        for module in computed:  # Note [buffers that are not in checkpoints]
            model._init_weights(module)
        done: set[int] = set()
        missing = []
        for module_name, module in model.named_modules():
            specs = getattr(module, "shard_specs", None)
            transposed = getattr(module, "source_transposed", False)
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b)
                for n, b in module.named_buffers(recurse=False)
                if n not in getattr(module, "_non_persistent_buffers_set", ())
            ]
            for name, tensor in tensors:
                full_name = f"{module_name}.{name}" if module_name else name
                if id(tensor) in done:
                    continue
                if full_name not in index:
                    missing.append(full_name)
                    continue
                spec = module.spec(name) if specs is not None and name in specs else None
                tensor.copy_(_read(index[full_name], full_name, spec, transposed))
                done.add(id(tensor))
        missing = [n for n in missing if id(_lookup(model, n)) not in done]  # a tied weight saved under its twin's name
    if missing:
        raise ConfigError(f"checkpoint: no tensor for {missing[:5]} in the checkpoint; is it this model's?")


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)
