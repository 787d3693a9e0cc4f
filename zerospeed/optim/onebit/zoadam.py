"""0/1 Adam (arXiv 2202.06009): 1-bit communication from the first step, variance refreshed on a
doubling schedule, then local steps with a doubling synchronisation interval.

Variance stage (step <= var_freeze_step). On steps where step % var_interval == 0 the engine
all-reduces the gradient and both moments update (m, v as Adam); on the others the rank's own
gradient is averaged by the 1-bit compressed all-reduce and only m updates. After var_update_scaler
full steps at one interval, the interval doubles (1, 2, 4, ...), so full-precision rounds thin out.
Local-step stage (step > var_freeze_step): v is frozen and every rank steps on its own gradient,
accumulating its parameter change u (and the summed learning rates L); every local_step_interval steps
the ranks synchronise: each undoes its local change, the changes scaled back to momentum units
(u * (sqrt(v) + eps)) are averaged 1-bit, m = -mean / L, and the parameters take the averaged step.
The interval doubles every local_step_scaler steps up to local_step_clipper.
Every update is p -= lr (m / D + wd p), D = sqrt(v) + eps (with bias correction, Note [1-bit bias
correction] in base.py). See Note [the engine's backward all-reduce].
"""

from __future__ import annotations

import torch

from zerospeed.optim.onebit.base import OneBitOptimizer, check_max_grad_norm, decay, denominator


class ZeroOneAdam(OneBitOptimizer):
    """DeepSpeed's `ZeroOneAdam` (config `"type": "ZeroOneAdam"`), same arguments and defaults."""

    name = "0/1 Adam"
    # Note [1-bit Adam under ZeRO-1/2]
    sharded_refusal = "its local steps give every rank weights of its own, and ZeRO keeps one owner per weight chunk"

    def __init__(
        self,
        params,
        deepspeed=None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        check_max_grad_norm(max_grad_norm)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.eps_inside_sqrt = eps_inside_sqrt
        self.freeze_key = False
        self._errors_reset = False
        super().__init__(
            params,
            dict(
                lr=lr,
                bias_correction=bias_correction,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                max_grad_norm=max_grad_norm,
            ),
            deepspeed=deepspeed,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            amsgrad=amsgrad,
        )

    def compressing(self) -> bool:
        """The next step's gradients arrive unreduced unless it is a full-precision variance step."""
        if self.freeze_key:
            return True
        state = self._any_state()
        if state is None:
            return False  # step 1: var_interval 1, a full step
        return (state["step"] + 1) % state["var_interval"] != 0

    def _any_state(self):
        first = self.param_groups[0]["params"][0]
        return self.state.get(first) or None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._check_bound()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    work.append((p, self._state(p), group))
        # momentum: from the all-reduced gradient, a 1-bit mean of the local ones, or the local one
        var_round = [not self.freeze_key and s["step"] % s["var_interval"] == 0 for _, s, _ in work]
        to_compress = [(p.grad, s) for (p, s, _), full in zip(work, var_round) if not self.freeze_key and not full]
        means = iter(self._allreduce_many(to_compress))
        for (p, s, group), full in zip(work, var_round):
            b1, b2 = group["betas"]
            g = p.grad if self.freeze_key or full else self._masked(next(means), group)
            if full:
                s["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                s["v_updates"] += 1
            s["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            if self.freeze_key:
                s["lrs"] += group["lr"]
        # the update; in the local-step stage, the synchronisation of the accumulated changes
        syncing = []
        for p, s, group in work:
            d = denominator(s["exp_avg_sq"], group, s["step"], s["v_updates"], self.eps_inside_sqrt)
            update = decay(s["exp_avg"] / d, p, group)
            p.add_(update, alpha=-group["lr"])
            if self.freeze_key:
                s["momentum_accumulator"].add_(update, alpha=-group["lr"])
                if s["step"] % s["local_step_interval"] == 0:
                    u = s["momentum_accumulator"]
                    p.sub_(u)  # undo the local steps ...
                    u.mul_(d)  # ... and average them in momentum units
                    syncing.append((p, s, group, d))
        for (p, s, group, d), mean in zip(
            syncing, self._allreduce_many([(s["momentum_accumulator"], s) for _, s, _, _ in syncing])
        ):
            u = s["momentum_accumulator"]
            u.copy_(self._masked(mean, group))
            s["exp_avg"].copy_(u / -s["lrs"])
            p.add_(u / d)
            u.zero_()
            s["lrs"] = 0.0
        for _p, s, _group in work:
            self._advance_schedule(s)
        if not self.freeze_key and self._first_step() > self.var_freeze_step:
            self.freeze_key = True
        if self.freeze_key and not self._errors_reset:
            self.reset_errors()  # the local-step stage compresses parameter changes: fresh errors
            self._errors_reset = True
        self._set_backward_allreduce(not self.compressing())
        return loss

    def _state(self, p) -> dict:
        state = self.state[p]
        if not state:
            state.update(
                step=0,
                v_updates=0,
                exp_avg=torch.zeros_like(p),
                exp_avg_sq=torch.zeros_like(p),
                var_interval=1,
                var_counter=0,
                local_step_interval=1,
                local_step_counter=0,
                lrs=0.0,
                momentum_accumulator=torch.zeros_like(p),
            )
        state["step"] += 1
        return state

    def _advance_schedule(self, state: dict) -> None:
        """The doubling intervals: variance rounds during the variance stage, then synchronisations."""
        if self.freeze_key:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
        elif state["step"] % state["var_interval"] == 0:
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2

    def _after_load(self) -> None:
        self.freeze_key = self._first_step() > self.var_freeze_step
        self._errors_reset = self.freeze_key
