"""Gradients of weights tied across pipeline stages (e.g. token embedding and output head).

Each stage holding a tied key has its own copy of the module. Its tied weights' gradients are caught
by a post-accumulate hook registered *before* the ZeRO strategy's own hooks, kept here in fp32 and
zeroed for the strategy; `reduce()` sums them over the stages that hold the key, and the engine
hands the sum (`acc`) to the strategy in one extra backward at the end of the batch (the strategy only sees
gradients through its hooks). The stages' copies stay identical because they start equal (broadcast
from the lowest stage) and step on identical gradients.
"""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.parallel.pipeline.module import PipelineModule, get_attr_path
from zerospeed.zero.reducer import weak_hook


class TiedGradients:
    """Hooks, buffers and reductions for this rank's tied weights."""

    def __init__(self, module: PipelineModule):
        self.module = module
        self.params: dict[str, list[torch.nn.Parameter]] = {
            key: [get_attr_path(module.tied_modules[key], a) for a in module.ties[key].attrs]
            for key in module.tie_groups
        }
        self.acc = {id(p): torch.zeros_like(p, dtype=torch.float32) for ps in self.params.values() for p in ps}
        self.capturing = True
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
            for ps in self.params.values()
            for p in ps
            if p.requires_grad
        ]
        self.duplicate_sq_norm = 0.0

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.capturing:
            return
        self.acc[id(param)].add_(param.grad)
        param.grad.zero_()  # the strategy's hook, next in line, adds nothing for this micro-batch

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Start every holder from the lowest holding stage's values."""
        for key, params in self.params.items():
            group, ranks = self.module.tie_groups[key]
            for p in params:
                comm.broadcast(p.data, src=ranks[0], group=group)

    @torch.no_grad()
    def reduce(self, dp_group, norm_weights: dict[int, float] | None = None) -> None:
        """Sum over the holding stages; note the squared norm the non-owners would count twice (each
        weight counted with its `norm_weights` share: 1/r for one replicated over r tensor-parallel ranks)."""
        self.duplicate_sq_norm = 0.0
        for key, params in self.params.items():
            group, ranks = self.module.tie_groups[key]
            owner = self.module.global_rank == ranks[0]
            for p in params:
                comm.all_reduce(self.acc[id(p)], op="sum", group=group)
                if not owner:
                    # the gradient the strategy will hold after its data-parallel average
                    avg = self.acc[id(p)].clone()
                    comm.all_reduce(avg, op="avg", group=dp_group)
                    weight = 1.0 if norm_weights is None else norm_weights.get(id(p), 1.0)
                    self.duplicate_sq_norm += weight * float(avg.double().pow(2).sum())

    def zero(self) -> None:
        for acc in self.acc.values():
            acc.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
