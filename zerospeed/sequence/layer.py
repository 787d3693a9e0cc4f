"""DeepSpeed-Ulysses: attention over a sequence split across ranks, by two all-to-alls per tensor.

Each rank holds a slice of the sequence with every head. Before attention, an all-to-all trades the
sequence slices for head blocks: afterwards each rank holds the whole sequence for its heads, so any
local attention (SDPA, flash, the model's own) runs unchanged; a second all-to-all trades back. Per
layer and rank the forward sends q, k, v and the context once each: 4 x (N/P) x h elements of payload
for sequence length N, hidden size h, degree P (of which (P-1)/P leaves the rank), the constant
per-link volume the Ulysses paper (arXiv 2309.14509) is built on; GQA sends fewer kv bytes.

Head counts need not divide the degree (Note [uneven heads] in `layout.py`), and kv heads fewer than
the degree are replicated to the ranks that read them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.comm.functional import all_to_all
from zerospeed.sequence.layout import HeadPlan


def _perm(ndim: int, seq_dim: int, head_dim: int) -> list[int]:
    return [seq_dim, head_dim] + [d for d in range(ndim) if d not in (seq_dim, head_dim)]


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _pick(x_SH: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    a, b = heads[0], heads[-1] + 1
    if list(heads) == list(range(a, b)):
        return x_SH[:, a:b]
    return x_SH.index_select(1, torch.tensor(heads, device=x_SH.device))


def sequence_to_heads(x: torch.Tensor, group, heads_per_rank, seq_dim: int, head_dim: int) -> torch.Tensor:
    """[.., N/P (seq_dim), .., H (head_dim), ..] -> [.., N, .., len(heads_per_rank[rank]), ..]: rank j
    receives the heads `heads_per_rank[j]` (a kv head may go to several ranks) for the whole sequence."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    perm = _perm(x.dim(), seq_dim, head_dim)
    x_SH = x.permute(perm)
    s_local, rest = x_SH.shape[0], x_SH.shape[2:]
    width = math.prod(rest)
    send = torch.cat([_pick(x_SH, heads).reshape(-1, width) for heads in heads_per_rank])
    mine = len(heads_per_rank[rank])
    recv = all_to_all(send, group, [s_local * mine] * world, [s_local * len(h) for h in heads_per_rank])
    return recv.reshape(world * s_local, mine, *rest).permute(_inverse(perm))


def heads_to_sequence(x: torch.Tensor, group, heads_per_rank, seq_dim: int, head_dim: int) -> torch.Tensor:
    """The inverse of `sequence_to_heads` for a head partition: [.., N, .., n_rank, ..] ->
    [.., N/P, .., H, ..], the heads concatenated in rank order."""
    world = comm.get_world_size(group)
    perm = _perm(x.dim(), seq_dim, head_dim)
    x_SH = x.permute(perm)
    seq, mine, rest = x_SH.shape[0], x_SH.shape[1], x_SH.shape[2:]
    if seq % world:
        raise ValueError(f"the gathered sequence ({seq}) is not divisible by the sequence-parallel degree {world}")
    s_local, width = seq // world, math.prod(rest)
    sizes = [s_local * len(h) for h in heads_per_rank]
    recv = all_to_all(x_SH.reshape(-1, width), group, sizes, [s_local * mine] * world)
    parts = [p.reshape(s_local, len(h), *rest) for p, h in zip(recv.split(sizes), heads_per_rank)]
    return torch.cat(parts, dim=1).permute(_inverse(perm))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) on the first `cos.shape[-1]` channels of `t`."""
    rot = cos.shape[-1]
    head, tail = t[..., :rot], t[..., rot:]
    return torch.cat((head * cos + _rotate_half(head) * sin, tail), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`: `local_attention(q, k, v, *args, **kwargs)`
    over the full sequence and this rank's heads, between the two all-to-alls.

    Inputs are sequence-sharded `[s/P, b, h, d]` (`batch_dim_idx=1`, Megatron's layout) or `[b, s/P, h, d]`
    (`batch_dim_idx=0`); `scatter_idx` is the head dimension (2, DeepSpeed's default). The local attention
    returns `[.., s, .., h_local, d]` or the heads flattened `[.., s, .., h_local * d]`; the output has the
    same form with `s/P` and every head. `rotary_pos_emb=(cos, sin)`, as Megatron passes it, is applied to
    q and k after the exchange (the full sequence is local then). `sp_stream` (a side CUDA stream for
    overlapping the q/k/v exchanges in DeepSpeed) is accepted; the exchanges run in order on the current stream.
    """

    def __init__(
        self,
        local_attention: nn.Module,
        sequence_process_group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
    ) -> None:
        super().__init__()
        if scatter_idx < 2:
            raise ValueError(
                f"scatter_idx={scatter_idx}: DistributedAttention scatters the head dimension, which is "
                "dimension 2 of [s, b, h, d] / [b, s, h, d] inputs; pass scatter_idx=2"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self._plans: dict[tuple[int, int], HeadPlan] = {}

    def plan(self, num_heads: int, num_kv_heads: int) -> HeadPlan:
        key = (num_heads, num_kv_heads)
        if key not in self._plans:
            self._plans[key] = HeadPlan.of(num_heads, num_kv_heads, comm.get_world_size(self.spg))
        return self._plans[key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int,
        rotary_pos_emb=None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx={batch_dim_idx}: 0 for [b, s, h, d] inputs, 1 for [s, b, h, d]")
        seq_dim, head_dim = 1 - batch_dim_idx, self.scatter_idx
        plan = self.plan(query.shape[head_dim], key.shape[head_dim])
        q = sequence_to_heads(query, self.spg, plan.q, seq_dim, head_dim)
        k = sequence_to_heads(key, self.spg, plan.kv, seq_dim, head_dim)
        v = sequence_to_heads(value, self.spg, plan.kv, seq_dim, head_dim)
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        flat = context.dim() == query.dim() - 1
        if flat:  # heads flattened into the last dimension
            context = context.unflatten(-1, (q.shape[head_dim], -1))
        out = heads_to_sequence(context, self.spg, plan.q, seq_dim, head_dim)
        return out.flatten(head_dim) if flat else out
