"""1-bit Adam (arXiv 2102.02888): Adam for `freeze_step` steps, then frozen variance and 1-bit momentum.

Warm-up (step <= freeze_step): the engine all-reduces gradients as usual;
    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2,   p -= lr (m / D + wd p),
D = sqrt(v) + eps (with bias correction: Note [1-bit bias correction] in base.py).
Compressed stage (step > freeze_step): v stays as it was; each rank's momentum from its own gradient
is averaged by the 1-bit compressed all-reduce (comm/compressed.py) and replaces the momentum:
    m = compressed_mean(b1 m + (1 - b1) g_local),   p -= lr (m / D + wd p).
Every rank ends a step with the same m (the compressed result is identical everywhere) and the same
p. All tensors are compressed in one set of collectives, each with its own scales and errors, as
DeepSpeed compresses each alone. See Note [the engine's backward all-reduce] in base.py; at ZeRO-1/2,
Note [1-bit Adam under ZeRO-1/2] there.
"""

from __future__ import annotations

import torch

from zerospeed.comm import backend
from zerospeed.optim.onebit.base import OneBitOptimizer, check_max_grad_norm, decay, denominator


class OnebitAdam(OneBitOptimizer):
    """DeepSpeed's `OnebitAdam` (config `"type": "OneBitAdam"`), same arguments and defaults."""

    name = "1-bit Adam"
    sharded_refusal = None  # Note [1-bit Adam under ZeRO-1/2]

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
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        check_max_grad_norm(max_grad_norm)
        self.freeze_step = freeze_step
        self.eps_inside_sqrt = eps_inside_sqrt
        self.adam_freeze_key = False
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
        return self.adam_freeze_key

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._check_bound()
        work, compressed, segments = [], [], []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state.update(step=0, v_updates=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                unit = self.shards.get(id(p))
                if self.adam_freeze_key and unit is not None:  # ZeRO-1/2: the whole local momentum
                    full = self._full_momentum(p, unit, m)
                    full.mul_(b1).add_(unit.accum, alpha=1 - b1)
                    segments.extend(self._segments(p, unit, full))
                    state["exp_avg"] = self._chunk_of(unit, full)
                    work.append((p, state, group))
                    continue
                if self.adam_freeze_key and group.get("non_freeze"):  # DeepSpeed's per-group opt-out
                    g = g.clone()
                    backend.all_reduce(g, op="avg", group=self.group)
                m.mul_(b1).add_(g, alpha=1 - b1)
                if not self.adam_freeze_key or group.get("non_freeze"):
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    state["v_updates"] += 1
                else:
                    compressed.append((m, state, group))
                work.append((p, state, group))
        pairs = [(m, s) for m, s, _ in compressed] + segments
        means = self._allreduce_many(pairs)
        for (m, _, group), mean in zip(compressed, means):
            m.copy_(self._masked(mean, group))
        for (piece, _), mean in zip(segments, means[len(compressed) :]):
            piece.copy_(mean)
        for p, state, group in work:
            d = denominator(state["exp_avg_sq"], group, state["step"], state["v_updates"], self.eps_inside_sqrt)
            p.add_(decay(state["exp_avg"] / d, p, group), alpha=-group["lr"])
        if not self.adam_freeze_key and self._steps_done() >= self.freeze_step:
            self.adam_freeze_key = True
            self._set_backward_allreduce(False)
        return loss

    def _after_load(self) -> None:
        self.adam_freeze_key = self._steps_done() >= self.freeze_step
