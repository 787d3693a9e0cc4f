"""Gating math of a Mixture-of-Experts layer: which expert slots each token goes to, with what weight.

Every function here takes the gate's fp32 logits `[S, E]` (S tokens, E experts) and returns
DeepSpeed's 4-tuple `(l_aux, combine_weights_SEC, dispatch_mask_SEC, exp_counts_E)`:

    dispatch_mask[s, e, c]    token s fills slot c of expert e's capacity buffer
    combine_weights[s, e, c]  the weight of that slot's expert output in token s's output
    exp_counts[e]             tokens routed to e before any was dropped (int64, no gradient)
    l_aux                     the load-balancing loss (differentiable in the logits)

The formulas (me = mean over tokens of the softmax gates, ce = fraction of tokens whose chosen
experts include e; both length E):

    capacity   C = max(ceil(S / E * cf * k), min_capacity)   (in fp32, as DeepSpeed computes it)
    top-1      l_aux = E * sum(me * ce1)       weight = gate of the chosen expert (not renormalised)
    top-2      l_aux = E * sum(me * ce1)       weights = the two kept gates / their sum
    top-k      l_aux = E * sum(me * ce_k) / k  weights = the kept gates / their sum

A token past an expert's capacity is dropped from that expert (its weight there is 0). Dropless
(`drop_tokens=False`) sizes C to the largest count over the expert-parallel group instead, so no
token is dropped and every rank's buffers keep one shape. Note [token order without RTS]: with
`use_rts=False` the first tokens in order win a full expert's slots (DeepSpeed takes a top-k over a
0/1 mask there, which leaves the choice among ties to the kernel); with RTS, uniform random priorities
choose them. The only collective is the dropless maximum, made over `ep_group` through the comm
gateway (`ep_group`: a comm group handle, None the world group — zerospeed's convention — and the
default `comm.SELF` this rank alone); on one rank every function is pure.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zerospeed import comm

_EPS = torch.finfo(torch.float32).eps


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ceil(tokens / experts * capacity_factor), at least `min_capacity`. The product is
    taken in fp32 (DeepSpeed's tensor arithmetic): 25 tokens x 1.2 give 31 slots, not 30."""
    value = torch.tensor(num_tokens / num_experts, dtype=torch.float32) * torch.tensor(
        capacity_factor, dtype=torch.float32
    )
    return max(math.ceil(float(value)), int(min_capacity))


def gumbel_rsample(shape, device=None) -> torch.Tensor:
    """Standard Gumbel noise (-log of an Exp(1) sample), from the default generator."""
    return -torch.empty(shape, device=device).exponential_().log()


def multiplicative_jitter(x: torch.Tensor, device=None, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (the Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    return x * (1.0 - epsilon + 2.0 * epsilon * torch.rand(x.shape, device=x.device if device is None else device))


def dropless_capacity(exp_counts: torch.Tensor, ep_group=comm.SELF) -> int:
    """The largest per-expert count on any rank of `ep_group` (one all-reduce there): the capacity at
    which no token is dropped and every rank's buffers agree in shape."""
    top = exp_counts.max().reshape(1).to(torch.int64).clone()
    if comm.get_world_size(ep_group) > 1:
        comm.all_reduce(top, op="max", group=ep_group)
    return int(top.item())


def _slots(mask_SE: torch.Tensor, locations_SE: torch.Tensor, weights_SE: torch.Tensor, cap: int):
    """combine [S, E, C] and dispatch [S, E, C] from a 0/1 keep mask, slot positions and weights."""
    slot_SEC = F.one_hot((locations_SE * mask_SE).long(), num_classes=cap).to(weights_SE.dtype)
    slot_SEC = slot_SEC * mask_SE.unsqueeze(-1).to(weights_SE.dtype)
    return weights_SE.unsqueeze(-1) * slot_SEC, slot_SEC.bool()


def _keep_first(mask_SE: torch.Tensor, cap: int) -> torch.Tensor:
    """Per expert, the first `cap` routed tokens (Note [token order without RTS])."""
    return mask_SE * (torch.cumsum(mask_SE, dim=0) - 1 < cap).to(mask_SE.dtype)


def _keep_top(mask_SE: torch.Tensor, priority_SE: torch.Tensor, cap: int) -> torch.Tensor:
    """Per expert, the `cap` routed tokens of highest priority (non-routed rows have priority 0)."""
    picked = torch.topk(priority_SE, k=min(cap, priority_SE.shape[0]), dim=0).indices
    chosen = torch.zeros_like(mask_SE).scatter_(0, picked, 1)
    return mask_SE * chosen


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=comm.SELF,
    use_tutel: bool = False,
):
    """Top-1 (Switch) gating; see the module docstring. `used_token` [S] (0/1) masks padding tokens out;
    `noisy_gate_policy="RSample"` picks the expert by logits + Gumbel noise (the weight stays the clean
    gate). `use_tutel` is accepted and ignored (zerospeed has no Tutel path)."""
    S, E = logits.shape
    if S < min_capacity:
        raise ValueError(
            f"top-1 gating: {S} tokens but min_capacity={min_capacity}; feed at least min_capacity "
            "tokens per rank or lower min_capacity"
        )
    gates_SE = F.softmax(logits, dim=1)
    scores = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates_SE
    mask_SE = F.one_hot(torch.argmax(scores, dim=1), num_classes=E)
    if used_token is not None:
        mask_SE = mask_SE * (used_token.reshape(-1, 1) != 0).to(mask_SE.dtype)
    exp_counts = mask_SE.sum(dim=0).detach()
    if drop_tokens:
        cap = capacity(S, E, capacity_factor, min_capacity)
    else:
        cap = min(dropless_capacity(exp_counts, ep_group), S)
    l_aux = torch.sum(gates_SE.mean(dim=0) * mask_SE.float().mean(dim=0)) * E
    if use_rts:
        mask_SE = _keep_top(mask_SE, mask_SE * torch.rand(mask_SE.shape, device=logits.device), cap)
    else:
        mask_SE = _keep_first(mask_SE, cap)
    locations_SE = torch.cumsum(mask_SE, dim=0) - 1
    combine, dispatch = _slots(mask_SE, locations_SE, gates_SE * mask_SE, cap)
    return l_aux, combine, dispatch, exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=comm.SELF,
    top2_2nd_expert_sampling: bool = True,
):
    """Top-2 (GShard) gating; the second expert is the best other one by logits (+ Gumbel noise when
    `top2_2nd_expert_sampling`). Second choices queue behind every first choice of their expert."""
    S, E = logits.shape
    gates_SE = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates_SE, dim=1), num_classes=E)
    second = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    mask2 = F.one_hot(torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1), num_classes=E)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.sum(gates_SE.mean(dim=0) * mask1.float().mean(dim=0)) * E
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        cap = capacity(S, E, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < cap).to(mask1.dtype)
        mask2 = mask2 * (loc2 < cap).to(mask2.dtype)
    else:
        cap = dropless_capacity(exp_counts, ep_group)
    g1 = (gates_SE * mask1).sum(dim=1, keepdim=True)
    g2 = (gates_SE * mask2).sum(dim=1, keepdim=True)
    denom = torch.clamp(g1 + g2, min=_EPS)
    c1, d1 = _slots(mask1, loc1, (g1 / denom) * mask1, cap)
    c2, d2 = _slots(mask2, loc2, (g2 / denom) * mask2, cap)
    return l_aux, c1 + c2, d1 | d2, exp_counts


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=comm.SELF,
    drop_policy: str = "probs",
):
    """Top-k gating for any k. A full expert keeps its routed tokens of highest gate ("probs") or the
    first ones in order ("position"); kept gates are renormalised per token."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"top-k gating: drop_policy={drop_policy!r}; expected 'probs' or 'position'")
    S, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k gating: k={k} with {E} experts; k must be between 1 and the number of experts")
    gates_SE = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates_SE, k=k, dim=1)
    mask_SE = torch.zeros_like(gates_SE, dtype=torch.int64).scatter_(1, top_idx, 1)
    exp_counts = mask_SE.sum(dim=0).detach()
    l_aux = torch.sum(gates_SE.mean(dim=0) * mask_SE.float().mean(dim=0)) * E / k
    if not drop_tokens:
        cap = dropless_capacity(exp_counts, ep_group)
    elif drop_policy == "probs":
        cap = capacity(S, E, capacity_factor * k, min_capacity)
        priority = torch.zeros_like(gates_SE).scatter(1, top_idx, top_gate.detach())
        mask_SE = _keep_top(mask_SE, priority, cap)
    else:
        cap = capacity(S, E, capacity_factor * k, min_capacity)
        mask_SE = _keep_first(mask_SE, cap)
    kept = gates_SE * mask_SE
    weights = kept / torch.clamp(kept.sum(dim=1, keepdim=True), min=_EPS)
    combine, dispatch = _slots(mask_SE, torch.cumsum(mask_SE, dim=0) - 1, weights, cap)
    return l_aux, combine, dispatch, exp_counts
