"""Re-pointing the `model_parameters` a user passed to `initialize` at parameters that replaced them.

AutoTP and AutoEP swap modules (and with them parameters) inside `initialize`, after the user took
`model.parameters()` or built param groups; both map the old parameters to the new ones with this.
"""
from __future__ import annotations

import torch


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
