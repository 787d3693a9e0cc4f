"""An independent Mixture-of-Experts reference for tests: plain loops over tokens and experts.

Nothing here uses zerospeed.moe: routing is decided token by token in Python (first come, first
served for a full expert; second choices queue behind every first choice, as in GShard), and each
token's output is the weighted sum of its kept experts applied to it alone. Built from torch ops, so
autograd through it gives the reference gradients.
"""

from __future__ import annotations

import math

import torch


def ref_capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """ceil(tokens / experts * factor) in fp32 (as the library documents), at least min_capacity."""
    return max(math.ceil(float(torch.tensor(tokens / experts) * torch.tensor(factor))), min_capacity)


def ref_routes(logits: torch.Tensor, k: int, cap: int | None, second_scores: torch.Tensor | None = None):
    """Per token, the kept (expert, weight) pairs; cap None = keep everything. k = 1 or 2 queue by
    choice rank (all first choices, then second ones); k > 2 keeps the highest gates of a full expert
    (the library's "probs" policy)."""
    S, E = logits.shape
    gates = torch.softmax(logits, dim=1)
    probs = gates.detach()  # decisions only: the weights below keep their gradient
    choices = []
    for s in range(S):
        order = sorted(range(E), key=lambda e: -float(probs[s, e]))
        if k == 2 and second_scores is not None:
            rest = [e for e in range(E) if e != order[0]]
            order = [order[0], max(rest, key=lambda e: float(second_scores[s, e].detach()))]
        choices.append(order[:k])
    kept = [[] for _ in range(S)]
    if k <= 2:
        count = [0] * E
        for rank in range(k):
            for s in range(S):
                e = choices[s][rank]
                if cap is None or count[e] < cap:
                    kept[s].append(e)
                count[e] += 1
    else:
        for e in range(E):
            routed = [s for s in range(S) if e in choices[s]]
            routed.sort(key=lambda s: -float(probs[s, e]))
            for s in routed[: len(routed) if cap is None else cap]:
                kept[s].append(e)
    routes = []
    for s in range(S):
        if k == 1:
            routes.append([(e, gates[s, e]) for e in kept[s]])
        else:
            total = sum((gates[s, e] for e in kept[s]), torch.zeros(()))
            total = torch.clamp(total, min=torch.finfo(torch.float32).eps)
            routes.append([(e, gates[s, e] / total) for e in kept[s]])
    return routes, choices


def ref_l_aux(logits: torch.Tensor, choices: list[list[int]], k: int) -> torch.Tensor:
    """E * sum_e mean_gate[e] * fraction[e]: top-1/2 count first choices only, top-k all k (and / k)."""
    S, E = logits.shape
    gates = torch.softmax(logits, dim=1)
    total = torch.zeros(())
    for e in range(E):
        me = gates[:, e].mean()
        if k <= 2:
            ce = sum(1 for s in range(S) if choices[s][0] == e) / S
        else:
            ce = sum(1 for s in range(S) if e in choices[s]) / S
        total = total + me * ce
    return total * E / (k if k > 2 else 1)


def ref_counts(choices: list[list[int]], E: int) -> list[int]:
    return [sum(c.count(e) for c in choices) for e in range(E)]


def ref_moe_forward(x_SM: torch.Tensor, gate_weight: torch.Tensor, experts, k: int, cap: int | None):
    """(output [S, M], l_aux, expert counts) of a dense MoE: every token through its kept experts."""
    logits = x_SM.float() @ gate_weight.float().t()
    routes, choices = ref_routes(logits, k, cap)
    rows = []
    for s in range(x_SM.shape[0]):
        y = torch.zeros_like(x_SM[s])
        for e, w in routes[s]:
            y = y + w * experts[e](x_SM[s : s + 1])[0]
        rows.append(y)
    return torch.stack(rows), ref_l_aux(logits, choices, k), ref_counts(choices, gate_weight.shape[0])
