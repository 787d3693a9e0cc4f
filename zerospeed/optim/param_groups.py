"""Normalising ``model_parameters`` into param groups of trainable tensors.

Accepts what ``torch.optim`` accepts: an iterable of tensors, of ``(name, tensor)`` pairs, or of
param-group dicts (whose own ``lr`` / ``weight_decay`` / ... are kept). Frozen parameters
(``requires_grad=False``) are dropped, and so are groups left empty: they would only carry
optimizer state and trip ZeRO's flattening.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.utils.errors import ConfigError

__all__ = ["substitute_parameters", "trainable_param_groups"]


def trainable_param_groups(
    model_parameters: Iterable[Any], *, allow_empty: bool = False
) -> tuple[list[dict[str, Any]], bool]:
    """Return ``(groups, was_flat)``: non-empty groups of trainable tensors, and whether the input
    was a flat iterable of tensors rather than of group dicts. Nothing trainable is an error, unless
    ``allow_empty`` (an engine around a frozen model): then ``groups`` is empty."""
    items = list(model_parameters)
    n_dicts = sum(isinstance(item, dict) for item in items)
    if 0 < n_dicts < len(items):
        raise ConfigError("model_parameters: mixes tensors and param-group dicts; pass one kind")
    was_flat = n_dicts == 0
    if was_flat:
        groups = [{"params": _trainable(items, where="model_parameters")}]
    else:
        groups = [_group(item, i) for i, item in enumerate(items)]
    kept = [g for g in groups if g["params"]]
    if not kept and not allow_empty:
        raise ConfigError(
            "model_parameters: no parameter requires grad, nothing to optimize "
            "(are all parameters frozen, or was an exhausted generator passed?)"
        )
    return kept, was_flat


def _group(item: dict[str, Any], index: int) -> dict[str, Any]:
    if "params" not in item:
        raise ConfigError(f"model_parameters[{index}]: a param-group dict needs a 'params' key")
    params = item["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return {**item, "params": _trainable(params, where=f"model_parameters[{index}]['params']")}


def _trainable(items: list[Any], where: str) -> list[torch.Tensor]:
    out = []
    for item in items:
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{where}: expected tensors, got {type(tensor).__name__}")
        if tensor.requires_grad:
            out.append(tensor)
    return out


def substitute_parameters(model_parameters, replaced: dict[int, torch.nn.Parameter]):
    """`model_parameters` (tensors or param-group dicts, as initialize accepts them) with every parameter
    whose id is in `replaced` swapped for its replacement; None stays None."""
    if model_parameters is None:
        return None
    out = []
    for item in model_parameters:
        if isinstance(item, dict):
            out.append({**item, "params": [replaced.get(id(p), p) for p in item["params"]]})
        else:
            out.append(replaced.get(id(item), item))
    return out
