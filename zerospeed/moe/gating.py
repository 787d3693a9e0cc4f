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
    # SELF is this rank alone: no collective, not even a size query (DeepSpeed's pg_utils.is_parallel)
    if ep_group is not comm.SELF and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(top, op=comm.ReduceOp.MAX, group=ep_group)
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
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """Top-1 (Switch) gating; see the module docstring. `used_token` [S] (0/1) masks padding tokens out;
    `noisy_gate_policy="RSample"` picks the expert by logits + Gumbel noise (the weight stays the clean
    gate). `sparse_routes`: the routes instead of the dense tensors (Note [sparse routes]). `use_tutel` is
    accepted and ignored (zerospeed has no Tutel path)."""
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
    if sparse_routes:
        return _sparse(l_aux, cap, E, [(mask_SE, locations_SE, gates_SE * mask_SE)], exp_counts)
    combine, dispatch = _slots(mask_SE, locations_SE, gates_SE * mask_SE, cap)
    return l_aux, combine, dispatch, exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=comm.SELF,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """Top-2 (GShard) gating; the second expert is the best other one by logits (+ Gumbel noise when
    `top2_2nd_expert_sampling`). Second choices queue behind every first choice of their expert.
    `sparse_routes`: the two routes instead of the dense tensors (Note [sparse routes])."""
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
    if sparse_routes:
        routes = [(mask1, loc1, (g1 / denom) * mask1), (mask2, loc2, (g2 / denom) * mask2)]
        return _sparse(l_aux, cap, E, routes, exp_counts)
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
    sparse_routes: bool = False,
):
    """Top-k gating for any k. A full expert keeps its routed tokens of highest gate ("probs") or the
    first ones in order ("position"); kept gates are renormalised per token. `sparse_routes`: the k
    routes (in order of gate, highest first) instead of the dense tensors (Note [sparse routes])."""
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
    locations_SE = torch.cumsum(mask_SE, dim=0) - 1
    if sparse_routes:
        routes = [(F.one_hot(top_idx[:, j], num_classes=E) * mask_SE, locations_SE, weights) for j in range(k)]
        return _sparse(l_aux, cap, E, routes, exp_counts)
    combine, dispatch = _slots(mask_SE, locations_SE, weights, cap)
    return l_aux, combine, dispatch, exp_counts


def _sparse(l_aux, cap: int, num_experts: int, routes, exp_counts):
    """Note [sparse routes]: DeepSpeed's `sparse_routes=True` form of a gating result, for a dispatch that
    gathers tokens into expert slots instead of multiplying by the one-hot [S, E, C] tensors:
    `(l_aux, capacity, num_experts, indices_KS, locations_KS, gates_KS, exp_counts)`, one row per route
    (k of them): route r of token s goes to slot locations[r, s] of expert indices[r, s] with weight
    gates[r, s]; a route dropped for capacity has expert index -1 (location 0, gate 0). Built from the
    same masks as the dense form, so summing every kept route's one-hot gives combine_weights exactly.
    `routes`: (mask_SE, locations_SE, weights_SE) per route, each mask with at most one expert per token."""
    indices, locations, gates = [], [], []
    for mask_SE, locations_SE, weights_SE in routes:
        kept_S = mask_SE.sum(dim=1) > 0
        indices.append(torch.where(kept_S, mask_SE.argmax(dim=1), torch.full_like(kept_S, -1, dtype=torch.long)))
        locations.append((locations_SE * mask_SE).sum(dim=1))
        gates.append((weights_SE * mask_SE).sum(dim=1))
    as_int = torch.int32
    return (
        l_aux,
        cap,
        num_experts,
        torch.stack(indices).to(as_int),
        torch.stack(locations).to(as_int),
        torch.stack(gates),
        exp_counts,
    )


# -- a dispatch over sparse routes (Note [sparse routes]): DeepSpeed's helpers of the same names ------------


def _route_slots(indices_KS: torch.Tensor, locations_KS: torch.Tensor, num_experts: int, capacity: int):
    """Each route's flat slot in the `[E * C]` expert buffer (expert * C + location); a dropped route
    (index -1) gets the spare slot E * C, which the encode fills with zeros and the decode reads as zeros."""
    slots = indices_KS.long() * capacity + locations_KS.long()
    return torch.where(indices_KS >= 0, slots, torch.full_like(slots, num_experts * capacity))


def _sparse_encode(x_SM: torch.Tensor, slots_KS: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The `[E, C, M]` expert input: every kept route's token copied into its slot (empty slots zero), what
    the dense form's einsum("sec,sm->ecm", dispatch_mask, x) gives."""
    S, M = x_SM.shape
    buffer = x_SM.new_zeros(num_experts * capacity + 1, M)  # + the spare slot of dropped routes
    tokens = torch.arange(S, device=x_SM.device).expand_as(slots_KS)
    buffer = buffer.index_add(0, slots_KS.reshape(-1), x_SM[tokens.reshape(-1)])
    return buffer[:-1].view(num_experts, capacity, M)


def _sparse_decode(expert_out_NM: torch.Tensor, slots_KS: torch.Tensor, gates_KS: torch.Tensor, num_tokens: int):
    """Each token's output: its routes' expert outputs (rows of the flat `[E * C, M]` buffer) weighted by
    their gates and summed, in fp32, cast back; what einsum("sec,ecm->sm", combine_weights, out) gives."""
    K, S = slots_KS.shape
    padded = torch.cat([expert_out_NM, expert_out_NM.new_zeros(1, expert_out_NM.shape[-1])])  # the spare slot
    routed_KSM = padded[slots_KS.reshape(-1)].view(K, num_tokens, -1).float()
    return (routed_KSM * gates_KS.float().unsqueeze(-1)).sum(dim=0).to(expert_out_NM.dtype)
