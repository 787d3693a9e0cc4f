"""The names DeepSpeed 0.19.8's AutoEP gives a transformers sparse-MoE block's weights, against the transformers
model's own (which zerospeed's AutoEP keeps, Note [AutoEP keeps the model's router] in moe/autoep.py): one table,
read by the AutoEP importers (deepspeed_autoep*.py) and the exporter (deepspeed_autoep_export.py).

Note [DeepSpeed AutoEP names]: DeepSpeed swaps a block at `{path}` for its AutoEP layer, which holds
- the router as `{path}.router.gate.weight` (transformers' `{path}.gate.weight`), and registers the same router
  module again as `{path}.gate` (the name transformers' output recorder looks for), so its module state dict also
  holds `{path}.gate.gate.weight`: the same tensor, kept out of the optimizer's parameters and `param_shapes`;
- the experts stacked as `{path}.experts.w1`, `w3` ([E, I, H]: rows 0..I-1 and I..2I-1 of transformers'
  `gate_up_proj [E, 2I, H]`, the gate and up halves) and `w2` (`down_proj`, [E, H, I]); in DeepSpeed's optimizer
  and `param_shapes` each block's experts come in the order w1, w2, w3, each rank holding its E / ep rows.
"""

from __future__ import annotations

import torch

ROUTER = "router.gate."  # DeepSpeed's router prefix under a block
ROUTER_ALIAS = "gate.gate."  # the same router under the alias DeepSpeed's layer registers
TRANSFORMERS_ROUTER = "gate."  # transformers' router prefix under a block
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # DeepSpeed's stacked expert weights, in its parameter order
GATE_UP, DOWN = "gate_up_proj", "down_proj"  # transformers' fused expert weights


def router_renames(path: str) -> dict[str, str]:
    """DeepSpeed's router prefix -> transformers' for the block at `path`."""
    return {f"{path}.{ROUTER}": f"{path}.{TRANSFORMERS_ROUTER}"}


def to_transformers(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj, down_proj) of DeepSpeed's stacked w1, w2, w3 (any leading expert count)."""
    return torch.cat([w1, w3], dim=1), w2


def to_autoep(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpeed's (w1, w2, w3) of transformers' gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], down, gate_up[:, half:]
