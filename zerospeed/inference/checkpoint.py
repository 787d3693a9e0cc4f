"""Load the `checkpoint` of the inference config into the (still whole) model.

Accepted: a `.safetensors` file, a torch file (`.bin` / `.pt`, a bare state dict or one under
DeepSpeed's `module` / `model` key), a directory of either, or DeepSpeed's checkpoint description —
`{"type": ..., "checkpoints": [file, ...], "version": ...}` as an object or a `.json` path — whose
file names are relative to `base_dir` (or the JSON's own directory). The weights are loaded into the
full model before AutoTP slices it; for a model built on the meta device, shard_load.py reads only
each rank's slices instead.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from zerospeed.utils.errors import ConfigError


def checkpoint_files(checkpoint: Any, base_dir: str = "") -> list[str]:
    """The files a `checkpoint` setting names (a file, a directory, DeepSpeed's JSON description)."""
    return _files_of(checkpoint, base_dir)


def _files_of(checkpoint: Any, base_dir: str) -> list[str]:
    if isinstance(checkpoint, dict):
        names = checkpoint.get("checkpoints")
        if not names:
            raise ConfigError('checkpoint: a checkpoint description needs a non-empty "checkpoints" list of files')
        names = [names] if isinstance(names, str) else list(names)
        return [os.path.join(base_dir, n) for n in names]
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        found = found or sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt")))
        if not found:
            raise ConfigError(f"checkpoint: directory {path!r} has no .safetensors, .bin or .pt files")
        return [os.path.join(path, f) for f in found]
    if path.endswith(".json"):
        with open(path) as f:
            return _files_of(json.load(f), base_dir or os.path.dirname(path))
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint: {path!r} does not exist")
    return [path]


def _read(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("module", "model"):  # DeepSpeed's engine checkpoints keep the weights under one of these
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            return state[key]
    return state


def load_checkpoint(model: nn.Module, checkpoint: Any, base_dir: str = "") -> None:
    """Load every file of `checkpoint` into `model`; a missing or unexpected weight is an error naming it."""
    state: dict[str, torch.Tensor] = {}
    for path in _files_of(checkpoint, base_dir):
        state.update(_read(path))
    result = model.load_state_dict(state, strict=False)
    tied = {n for n in result.missing_keys if _is_tied(model, n)}
    missing = [n for n in result.missing_keys if n not in tied]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"checkpoint: does not match the model: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}; is it this model's checkpoint?"
        )


def _is_tied(model: nn.Module, name: str) -> bool:
    """A weight the checkpoint may leave out because it is the same tensor as another one (a tied head)."""
    target = dict(model.named_parameters(remove_duplicate=False)).get(name)
    return target is not None and sum(p is target for _, p in model.named_parameters(remove_duplicate=False)) > 1
