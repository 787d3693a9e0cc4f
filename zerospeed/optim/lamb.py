"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), DeepSpeed FusedLamb semantics.

Per parameter tensor, at step t (moments zero-initialised, same dtype as the parameter):

    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    m_hat  = m / (1 - beta1^t)          v_hat = v / (1 - beta2^t)       (if bias_correction)
    denom  = sqrt(v_hat) + eps          (sqrt(v_hat + eps) if eps_inside_sqrt)
    update = m_hat / denom + weight_decay * p
    ratio  = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 if either norm is 0
    p      = p - lr * ratio * update

Note [LAMB on ZeRO shards]: the trust ratio needs the norms of the *whole* tensor. On a ZeRO
shard the local norms differ, which is why LAMB is not in the ZeRO-tested optimizer set
(``zerospeed.optim.factory.ZERO_TESTED_OPTIMIZERS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed.optim._kwargs import check_common_hyperparams

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """The LAMB optimizer with DeepSpeed ``FusedLamb``'s parameters and defaults.

    ``max_grad_norm`` is deliberately not a parameter: clip with the top-level
    ``gradient_clipping`` instead. ``get_lamb_coeffs()`` returns the trust ratios of the last
    step, one per updated tensor, like FusedLamb.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        _check_args(lr, betas, eps, weight_decay, max_coeff, min_coeff)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last step (one per parameter that had a gradient)."""
        return [float(c) for c in self._lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = self._gather(group)
            if params:
                coeffs = _lamb_update(params, grads, exp_avgs, exp_avg_sqs, steps, group)
                self._lamb_coeffs.extend(coeffs)
        return loss

    def _gather(self, group: dict[str, Any]) -> tuple[list, list, list, list, list[int]]:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                # A CPU float tensor, as torch's Adam keeps it: checkpoint code sees one convention.
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(int(state["step"]))
        return params, grads, exp_avgs, exp_avg_sqs, steps


def _lamb_update(
    params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list[int], group: dict[str, Any]
) -> list[torch.Tensor]:
    beta1, beta2 = group["betas"]
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    update = _adam_direction(exp_avgs, exp_avg_sqs, steps, group)
    if group["weight_decay"] != 0:
        torch._foreach_add_(update, params, alpha=group["weight_decay"])
    coeffs = _trust_ratios(params, update, group["min_coeff"], group["max_coeff"])
    # Scale each tensor's update by its own (0-dim tensor) ratio; no host sync.
    torch._foreach_mul_(update, coeffs)
    torch._foreach_add_(params, update, alpha=-group["lr"])
    return coeffs


def _adam_direction(exp_avgs: list, exp_avg_sqs: list, steps: list[int], group: dict[str, Any]) -> list:
    """m_hat / denom per tensor; bias corrections differ per tensor when step counts differ."""
    beta1, beta2 = group["betas"]
    if group["bias_correction"]:
        bc1 = [1.0 - beta1**t for t in steps]
        bc2 = [1.0 - beta2**t for t in steps]
    else:
        bc1 = bc2 = [1.0] * len(steps)
    m_hat = torch._foreach_div(exp_avgs, bc1)
    v_hat = torch._foreach_div(exp_avg_sqs, bc2)
    if group["eps_inside_sqrt"]:
        torch._foreach_add_(v_hat, group["eps"])
        denom = torch._foreach_sqrt(v_hat)
    else:
        denom = torch._foreach_sqrt(v_hat)
        torch._foreach_add_(denom, group["eps"])
    torch._foreach_div_(m_hat, denom)
    return m_hat


def _trust_ratios(params: list, update: list, min_coeff: float, max_coeff: float) -> list[torch.Tensor]:
    w_norms = torch._foreach_norm(params)
    u_norms = torch._foreach_norm(update)
    ratios = []
    for w, u in zip(w_norms, u_norms):
        ratio = (w / u).clamp(min_coeff, max_coeff)
        # An all-zero weight (fresh bias) or zero update has no meaningful ratio: use 1.
        ratios.append(torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio)))
    return ratios


def _check_args(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, max_coeff: float, min_coeff: float
) -> None:
    check_common_hyperparams("Lamb", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if not 0.0 < min_coeff <= max_coeff:
        raise ValueError(f"Lamb: need 0 < min_coeff <= max_coeff, got min {min_coeff}, max {max_coeff}")
