"""`Experts`: this rank's local experts, each a deep copy of the module given (DeepSpeed's semantics:
all experts of a layer start equal; the gate's routing makes them diverge).

Note [expert parameter tags]: DeepSpeed marks an expert parameter by bolting two attributes onto it
(`allreduce = False`, `group_name = "ep_size_N"`). zerospeed writes the expert group into the
parameter's one typed tag (Note [parameter tags], zero/tags.py), which ZeRO reads without importing
this package: `Experts` tags its parameters when it is built, and again when it is deep-copied or
unpickled (`__setstate__`: a parameter's copy has no tag). `expert_group_name(p)` also honours
DeepSpeed's attributes on parameters someone else tagged, so hand-written experts keep working.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerospeed.zero import tags


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group ("ep_size_N") `param` belongs to, or None for a dense parameter."""
    return tags.expert_group(param)


class Experts(nn.Module):
    """`num_local_experts` copies of `expert` in `deepspeed_experts` (DeepSpeed's state-dict names).
    The input [ep, local, C, M] is split along dim 1: local expert j sees its own slots."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        self._tag()

    def _tag(self) -> None:  # Note [expert parameter tags]
        for p in self.deepspeed_experts.parameters():
            tags.mark_expert(p, self.expert_group_name or "ep_size_1")

    def __setstate__(self, state) -> None:  # deepcopy / unpickle: the copies are expert parameters too
        super().__setstate__(state)
        self._tag()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outputs, dim=1)
