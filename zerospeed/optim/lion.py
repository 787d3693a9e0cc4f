"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Per parameter, with momentum ``m`` (zero-initialised, same dtype as the parameter):

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update      # decoupled weight decay
    m      = beta2 * m + (1 - beta2) * g

Element-wise only, so it is exact on ZeRO shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed.optim._kwargs import check_common_hyperparams

__all__ = ["DeepSpeedCPULion", "FusedLion", "Lion"]


class Lion(torch.optim.Optimizer):
    """The Lion optimizer, vectorised with ``torch._foreach_*`` per parameter group.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate (paper default 1e-4; Lion wants a 3-10x smaller lr than AdamW).
        betas: (beta1, beta2) — interpolation for the update direction, and momentum decay.
        weight_decay: decoupled weight decay coefficient (multiplied by lr).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        check_common_hyperparams("Lion", lr=lr, betas=betas, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = self._gather(group)
            if params:
                _lion_update(params, grads, exp_avgs, group)
        return loss

    def _gather(self, group: dict[str, Any]) -> tuple[list, list, list]:
        params, grads, exp_avgs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        return params, grads, exp_avgs


def _lion_update(params: list, grads: list, exp_avgs: list, group: dict[str, Any]) -> None:
    lr, wd = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    direction = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(direction)
    if wd != 0:
        torch._foreach_mul_(params, 1.0 - lr * wd)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)


class FusedLion(Lion):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
