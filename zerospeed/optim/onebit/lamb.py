"""1-bit LAMB (arXiv 2104.06069): LAMB for `freeze_step` steps, then 1-bit momentum with a frozen
variance and a frozen trust ratio adapted by how far the variance has moved.

Warm-up (step <= freeze_step): LAMB, D = sqrt(v) + eps (with bias correction: Note [1-bit bias
correction] in base.py):
    u = m / D + wd p,   c = clip(||p|| / ||u||, min_coeff, max_coeff)  (1 if a norm is 0),
    p -= lr c u;  c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c  (when c != 1).
At step freeze_step a fresh copy v' of v starts. Compressed stage: every tensor's momentum is scaled
by a per-tensor coefficient fixed at the first compressed step (the mean momentum scale over tensors /
this tensor's: ||m|| / sqrt(n)), so that one flat 1-bit all-reduce of the whole model's momentum
treats all tensors alike; after it the scaling is undone. The gradient the averaged momentum implies,
g' = (m - b1 m_prev) / (1 - b1), keeps v' fresh, and the trust ratio is c_frozen times
    f = max(D(v) / D(v'))   (mixed with 1 by the share of wd in ||u||),
clipped to [factor_min, factor_max] and to within factor_threshold of the previous step's f.
"""

from __future__ import annotations

import math

import torch

from zerospeed.optim.onebit.base import OneBitOptimizer, check_max_grad_norm, denominator


class OnebitLamb(OneBitOptimizer):
    """DeepSpeed's `OnebitLamb` (config `"type": "OneBitLamb"`), same arguments and defaults."""

    name = "1-bit LAMB"
    # Note [1-bit Adam under ZeRO-1/2]
    sharded_refusal = "its trust ratio is a norm of each whole parameter, which ZeRO's flat chunks cut apart"

    def __init__(
        self,
        params,
        deepspeed=None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ):
        check_max_grad_norm(max_grad_norm)
        self.freeze_step = freeze_step
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold
        self.lamb_freeze_key = False
        self.lamb_coeffs: list[float] = []
        self._flat_state: dict = {}  # the flat momentum's compression errors
        super().__init__(
            params,
            dict(
                lr=lr,
                bias_correction=bias_correction,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                max_grad_norm=max_grad_norm,
                max_coeff=max_coeff,
                min_coeff=min_coeff,
            ),
            deepspeed=deepspeed,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            amsgrad=amsgrad,
        )

    def compressing(self) -> bool:
        return self.lamb_freeze_key

    def _params(self):
        return [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._check_bound()
        self.lamb_coeffs = []
        for p, _group in self._params():
            state = self.state[p]
            if "step" not in state:
                state.update(
                    step=0,
                    v_updates=0,
                    lamb_coeff_freeze=0.0,
                    last_factor=1.0,
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                    exp_avg_sq_fresh=torch.zeros_like(p),
                )
        if self.lamb_freeze_key:
            self._compressed_step()
        else:
            for p, group in self._params():
                self._warmup_param(p, p.grad, group)
            if self._first_step() >= self.freeze_step:
                self.lamb_freeze_key = True
                self._set_backward_allreduce(False)
        return loss

    def _warmup_param(self, p, g, group) -> None:
        state = self.state[p]
        b1, b2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        state["v_updates"] += 1
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = v.clone()
        update = m / denominator(v, group, state["step"], state["v_updates"])
        if group["weight_decay"] > 0:
            update += group["weight_decay"] * p
        weight_norm, update_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def unsaved_state_bytes(self) -> int:
        """Also the flat momentum's compression errors, kept outside `self.state`."""
        return super().unsaved_state_bytes() + sum(t.nbytes for t in self._flat_state.values())

    def _compressed_step(self) -> None:
        pairs = self._params()
        states = [self.state[p] for p, _ in pairs]
        if "scaling_coeff" not in states[0]:
            scales = [float(torch.linalg.vector_norm(s["exp_avg"])) / math.sqrt(s["exp_avg"].numel()) for s in states]
            united = sum(scales) / len(scales)
            for s, scale in zip(states, scales):
                s["scaling_coeff"] = united / scale if scale > 0 else 1.0
        last = [s["exp_avg"].clone() for s in states]
        for (p, group), s in zip(pairs, states):
            b1 = group["betas"][0]
            s["step"] += 1
            s["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1).mul_(s["scaling_coeff"])
        flat = torch.cat([s["exp_avg"].reshape(-1) for s in states])
        flat = self._allreduce(flat, self._flat_state)
        offset = 0
        for (p, group), s, m_prev in zip(pairs, states, last):
            m = s["exp_avg"]
            m.copy_(flat[offset : offset + m.numel()].view_as(m))
            offset += m.numel()
            m.div_(s["scaling_coeff"])
            self._masked(m, group)
            self._compressed_param(p, group, s, m_prev)

    def _compressed_param(self, p, group, state, m_prev) -> None:
        b1, b2 = group["betas"]
        m, v, v_fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        g_implied = (m - m_prev * b1) / (1 - b1)
        v_fresh.mul_(b2).addcmul_(g_implied, g_implied, value=1 - b2)
        denom = denominator(v, group, state["step"], state["v_updates"])
        prelim = m / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
        factor = float((denom / denominator(v_fresh, group, state["step"], state["step"])).max())
        if group["weight_decay"] > 0:
            ratio = min(1.0, float(prelim.norm() / update.norm()))
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def reset_errors(self) -> None:
        super().reset_errors()
        self._flat_state.clear()

    def _after_load(self) -> None:
        self._flat_state.clear()
        self.lamb_freeze_key = self._first_step() >= self.freeze_step
