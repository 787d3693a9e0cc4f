"""The gate (`TopKGate`) and the expert-parallel layer (`MOELayer`) at DeepSpeed's path.

A forward (GShard's algorithm 2, one capacity buffer per expert):

    x_SM --gate--> combine_SEC, dispatch_SEC
    dispatch: slots_ECM = sum_s dispatch[s, e, c] x[s]          (E = ep_size x local experts)
    all-to-all over the expert-parallel group: rank j receives every rank's slots of its own experts
    experts on [ep, local, C, M]; all-to-all back
    combine: y_SM = sum_ec combine[s, e, c] out[e, c]

Note [expert parallel layout]: global expert e lives on expert-parallel rank e // local_experts, as
its local expert e % local_experts; every rank of an expert-data-parallel group holds the same ones.

Note [expert gradient scale]: an expert replica serves the tokens of all `ep_size` ranks of its
expert-parallel group, so autograd gives it the sum of `ep_size` ranks' loss gradients, while the
engine averages an expert group over its expert-data-parallel ranks only (dp / ep of them). The mean
over all dp ranks' losses is therefore 1/ep of that sum: the experts' parameter gradients are scaled
by 1/ep in backward (`_ScaleGrad` around the experts: x ep on the way in, 1/ep on the way out, so
the gradient that flows back to the tokens is unchanged). DeepSpeed once got this wrong (#5618).

Note [dist]: as in DeepSpeed's module, `dist` here is the comm package itself and `_AllToAll.apply(group, x)`
is the layer's all-to-all, both looked up when called: the gates' capacity all-reduce goes through
`comm.all_reduce` (`dist.all_reduce`), so code that patches `sharded_moe.dist` or `_AllToAll` sees every
call. The gating functions at this path take DeepSpeed's `ep_group`: None is no expert parallelism (no
collective), where zerospeed.moe.gating's None is the world group.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed import comm
from zerospeed.comm.functional import all_to_all
from zerospeed.moe import gating
from zerospeed.moe.dropless import run_dropless
from zerospeed.moe.experts import Experts
from zerospeed.moe.gating import _route_slots as _route_slots  # DeepSpeed's sparse-dispatch helpers
from zerospeed.moe.gating import _sparse_decode as _sparse_decode
from zerospeed.moe.gating import _sparse_encode as _sparse_encode
from zerospeed.moe.gating import (
    capacity,
    dropless_capacity,
    gumbel_rsample,
    multiplicative_jitter,
)
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)
dist = comm  # DeepSpeed's module-level name for its comm package (Note [dist])

__all__ = [
    "MOELayer",
    "TopKGate",
    "capacity",
    "dropless_capacity",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]


def _no_group(ep_group):
    """DeepSpeed's `ep_group=None` (no expert parallelism) as zerospeed's group of this rank alone."""
    return comm.SELF if ep_group is None else ep_group


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """zerospeed.moe.gating.top1gating with DeepSpeed's `ep_group` (Note [dist])."""
    return gating.top1gating(
        logits,
        capacity_factor,
        min_capacity,
        used_token,
        noisy_gate_policy,
        drop_tokens,
        use_rts,
        _no_group(ep_group),
        sparse_routes=sparse_routes,
        use_tutel=use_tutel,
    )


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """zerospeed.moe.gating.top2gating with DeepSpeed's `ep_group` (Note [dist])."""
    return gating.top2gating(
        logits,
        capacity_factor,
        min_capacity,
        drop_tokens,
        _no_group(ep_group),
        top2_2nd_expert_sampling,
        sparse_routes=sparse_routes,
    )


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
):
    """zerospeed.moe.gating.topkgating with DeepSpeed's `ep_group` (Note [dist])."""
    return gating.topkgating(
        logits,
        k,
        capacity_factor,
        min_capacity,
        drop_tokens,
        _no_group(ep_group),
        drop_policy,
        sparse_routes=sparse_routes,
    )


class _AllToAll:
    """DeepSpeed's name for the layer's differentiable all-to-all over the expert-parallel group
    (comm.functional.all_to_all; Note [dist])."""

    @staticmethod
    def apply(group, input: torch.Tensor) -> torch.Tensor:
        return all_to_all(input, group)


class _Fp32Linear(nn.Linear):
    """A bias-free linear layer that computes in fp32 whatever its weight's dtype (routing decisions are
    fragile in 16-bit). Called as a module, so ZeRO-3 gathers its weight around the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float())


class TopKGate(nn.Module):
    """The router: a bias-free linear layer `wg` computed in fp32, then top-1 / top-2 / top-k gating.

    Returns (l_aux, combine_weights, dispatch_mask, exp_counts) (zerospeed.moe.gating). In eval mode the
    eval capacity factor applies and no noise is added. `ep_group` is the group the dropless capacity is
    agreed over: None here means none (this rank alone, as in DeepSpeed); the layer sets the real
    one, where — zerospeed's convention — None is the world group."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}; expected None, 'Jitter' or 'RSample'")
        if k < 1 or k > num_experts:
            raise ValueError(f"k={k} with {num_experts} experts; each token needs 1 <= k <= num_experts experts")
        self.wg = _Fp32Linear(model_dim, num_experts, bias=False)
        self.ep_group = comm.SELF if ep_group is None else ep_group
        self.k = k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ):
        """The gating result for `input`; with `sparse_routes`, the routes (Note [sparse routes], gating.py)."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = self.wg(x)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noise = self.noisy_gate_policy if self.training else None
            return gating.top1gating(
                logits,
                cf,
                self.min_capacity,
                used_token,
                noise,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
                sparse_routes=sparse_routes,
            )
        if self.k == 2:
            return gating.top2gating(
                logits,
                cf,
                self.min_capacity,
                self.drop_tokens,
                self.ep_group,
                self.top2_2nd_expert_sampling,
                sparse_routes=sparse_routes,
            )
        return gating.topkgating(
            logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group, sparse_routes=sparse_routes
        )


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `factor` (Note [expert gradient scale])."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class MOELayer(nn.Module):
    """Gate, dispatch, all-to-all, local experts, all-to-all, combine (module docstring). Sets `l_aux`
    and `exp_counts` on every forward."""

    def __init__(
        self,
        gate: nn.Module,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group = comm.SELF
        self._bound = ep_size == 1  # Note [expert groups at initialize] (moe/layer.py)
        self.ep_size, self.ep_group_name = ep_size, ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        if use_tutel:
            logger.warning("use_tutel=True: zerospeed has no Tutel kernels; using the einsum dispatch")
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0

    def _set_ep_group(self, ep_group) -> None:
        """The expert-parallel group (a comm group handle; None is the world group). A dropless gate
        keeps its own rank's capacity: the exchange sends exact counts (Note [dropless exchange])."""
        self.ep_group, self._bound = ep_group, True
        self.gate._set_ep_group(comm.SELF if self._exact_dropless else ep_group)

    @property
    def _exact_dropless(self) -> bool:
        """Dropless with zerospeed's `Experts`: tokens travel by exact counts (Note [dropless exchange])."""
        return not self.gate.drop_tokens and isinstance(self.experts, Experts)

    def __getstate__(self):
        # the last forward's l_aux is part of an autograd graph, which cannot be deep-copied or pickled
        return {**self.__dict__, "l_aux": None, "exp_counts": None}

    def _check_bound(self) -> None:
        if not self._bound:
            raise RuntimeError(
                f"MoE layer {self.ep_group_name!r} has no expert-parallel group yet: pass the model "
                "through zerospeed.initialize (which gives every MoE layer its groups from the mesh), "
                "or call moe.bind_mesh(mesh) first"
            )

    def _exchange(self, slots_ECM: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return slots_ECM.contiguous()
        self._check_bound()
        return _AllToAll.apply(self.ep_group, slots_ECM)

    def _scaled(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn(x) with the experts' parameter gradients scaled by 1 / ep (Note [expert gradient scale])."""
        if self.ep_size == 1:
            return fn(x)
        return _ScaleGrad.apply(fn(_ScaleGrad.apply(x, float(self.ep_size))), 1.0 / self.ep_size)

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        x = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = x.shape[-1]
        x_SM = x.reshape(-1, d_model)
        self.l_aux, combine_SEC, dispatch_SEC, self.exp_counts = self.gate(x_SM, used_token)
        slots_ECM = torch.einsum("sec,sm->ecm", dispatch_SEC.type_as(x), x_SM)
        if self.ep_size > 1 and self._exact_dropless:  # Note [dropless exchange]
            self._check_bound()
            counts = dispatch_SEC.any(dim=2).sum(dim=0).tolist()
            out_ECM = run_dropless(
                slots_ECM, counts, self.experts.deepspeed_experts, self.ep_group, self.ep_size, self._scaled
            )
        else:
            received = self._exchange(slots_ECM)  # Note [expert parallel layout]
            received = received.reshape(self.ep_size, self.num_local_experts, -1, d_model)
            out = self._scaled(self.experts, received)
            out_ECM = self._exchange(out.reshape(self.ep_size * self.num_local_experts, -1, d_model))
        y_SM = torch.einsum("sec,ecm->sm", combine_SEC.type_as(x), out_ECM)
        return y_SM.reshape(x.shape)
