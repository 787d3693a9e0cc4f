"""Differentiable collectives: all-to-alls whose backward is the conjugate all-to-all.

These are what sequence parallelism (Ulysses: sequence-sharded <-> head-sharded) and expert
parallelism (tokens to their experts' ranks and back) are built from. The forward sends through the
comm gateway, so every byte is counted in `comm.STATS` (kind "all_to_all").

Note [all-to-all conjugate]: an all-to-all is a permutation of slices between ranks; its adjoint is
the inverse permutation, i.e. the all-to-all with the split sizes swapped (uneven) or the scatter and
gather dimensions swapped (the sequence form). No reduction is involved, so the backward is exact.
"""

from __future__ import annotations

import torch

from zerospeed.comm import backend


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        x = x.contiguous()
        rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = x.new_empty((rows, *x.shape[1:]))
        backend.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits  # Note [all-to-all conjugate]
        return _AllToAllSingle.apply(grad, ctx.group, in_splits, out_splits), None, None, None


def all_to_all(
    x: torch.Tensor, group=None, output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None
) -> torch.Tensor:
    """Rows of `x` (dim 0) to the ranks of `group`: slice j goes to rank j; the result holds the slices
    received, in rank order. Equal slices without split sizes; uneven with them. Differentiable."""
    if backend.get_world_size(group) == 1:
        return x
    return _AllToAllSingle.apply(x, group, output_split_sizes, input_split_sizes)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims  # Note [all-to-all conjugate]
        return _SeqAllToAll.apply(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = backend.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of a {tuple(x.shape)} tensor is not divisible by the "
            f"group size {world}; pad it to a multiple of {world} first"
        )
    send_P = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # [P, ...]: slice j for rank j
    recv_P = torch.empty_like(send_P)
    backend.all_to_all_single(recv_P, send_P, group=group)
    return torch.cat(recv_P.unbind(0), dim=gather_dim)  # rank j's slice is the j-th piece of gather_dim


def seq_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into one piece per rank, send piece j to rank j, and concatenate the
    pieces received along `gather_dim` (rank order). With scatter = heads and gather = sequence, a
    sequence-sharded [s/P, h, d] tensor becomes head-sharded [s, h/P, d]; swapping the dims undoes it.
    Differentiable (the backward is the swapped exchange)."""
    if backend.get_world_size(group) == 1:
        return x
    ndim = x.dim()
    return _SeqAllToAll.apply(x, group, scatter_dim % ndim, gather_dim % ndim)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        backend.all_reduce(out, op="sum", group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Every rank's output is the same sum, so d(output_r)/d(x_q) = 1 for every r, q: the adjoint
        # all-reduces the upstream gradients.
        return _AllReduceSum.apply(grad.contiguous(), ctx.group), None


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, on every rank; differentiable (the backward all-reduces
    the gradients, so a loss built from it and averaged over the group's ranks gets exact gradients)."""
    if backend.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
