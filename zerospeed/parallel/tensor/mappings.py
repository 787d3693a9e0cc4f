"""The conjugate autograd collectives of tensor parallelism, through the comm gateway.

Each region boundary is a pair of an operation and its adjoint (Note [conjugate pairs]):

    copy_to_tensor_region          fwd identity            bwd all-reduce
    reduce_from_tensor_region      fwd all-reduce          bwd identity
    scatter_to_tensor_region       fwd split last dim      bwd all-gather last dim
    gather_from_tensor_region      fwd all-gather last dim bwd split last dim
    reduce_scatter_to_sequence     fwd reduce-scatter dim  bwd all-gather dim       (Megatron SP)
    gather_from_sequence           fwd all-gather dim      bwd reduce-scatter dim   (Megatron SP)

Note [conjugate pairs]: a tensor replicated on every tp rank that feeds a rank-local computation has,
as its true gradient, the *sum* of the ranks' gradients: hence identity forward / all-reduce backward.
A sum of per-rank partial results (a row-parallel matmul) is the opposite: every rank's partial
output receives the same full gradient, so the backward is the identity. Split and gather are each
other's adjoints, and reduce-scatter is the adjoint of all-gather. The group is always explicit; with
a one-rank group every operation is the identity.
"""

from __future__ import annotations

import torch

from zerospeed.comm import backend

# Note [flat buffers]: the gateway's gloo path moves flat per-rank chunks; the per-rank side is passed
# flat here too (the data is contiguous, so a view costs nothing).


def _world(group) -> int:
    return backend.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place a tensor autograd may have saved
    backend.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group, sizes: list[int] | None) -> torch.Tensor:
    rank, world = backend.get_rank(group), _world(group)
    if sizes is None:
        if x.shape[-1] % world:
            raise ValueError(f"split: last dimension {x.shape[-1]} is not divisible by the tp size {world}")
        sizes = [x.shape[-1] // world] * world
    return x.split(sizes, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group, sizes: list[int] | None) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim; `sizes` (per rank) allows uneven pieces, which
    travel padded to the largest and are trimmed after."""
    world = _world(group)
    width = x.shape[-1] if sizes is None else max(sizes)
    local = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    out = local.new_empty((world, *local.shape))
    backend.all_gather_into_tensor(out, local.contiguous().view(-1), group=group)  # Note [flat buffers]
    pieces = out.unbind(0) if sizes is None else [p[..., :n] for p, n in zip(out.unbind(0), sizes)]
    return torch.cat(pieces, dim=-1)


def _gather_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = _world(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    backend.all_gather_into_tensor(out, front.view(-1), group=group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = _world(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"sequence parallelism: dimension {dim} of a {tuple(x.shape)} tensor is not divisible "
            f"by the tp size {world}; make the sequence length a multiple of {world}"
        )
    front = x.movedim(dim, 0).contiguous().clone()  # the reduce-scatter may scale its input in place
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    backend.reduce_scatter_tensor(out.view(-1), front, group=group)
    return out.movedim(0, dim)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _split_last(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, ctx.sizes), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_last(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.group, ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, all-reduce backward."""
    return x if _world(group) == 1 else _Copy.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a region by summing the ranks' partial results: all-reduce forward, identity backward."""
    return x if _world(group) == 1 else _Reduce.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim (equal slices, or `sizes` per rank); bwd all-gathers."""
    return x if _world(group) == 1 else _Scatter.apply(x, group, sizes)


def gather_from_tensor_region(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate the ranks' last-dim slices (uneven with `sizes`, per rank); bwd keeps this rank's slice."""
    return x if _world(group) == 1 else _Gather.apply(x, group, sizes)


def reduce_scatter_to_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum the ranks' partial results and keep this rank's slice of `dim` (the sequence): Megatron
    sequence parallelism after a row-parallel layer. Backward all-gathers along `dim`."""
    return x if _world(group) == 1 else _ReduceScatterSeq.apply(x, group, dim % x.dim())


def gather_from_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather the sequence slices along `dim` (before a column-parallel layer); backward
    reduce-scatters, because every rank's full-sequence gradient is a partial sum."""
    return x if _world(group) == 1 else _GatherSeq.apply(x, group, dim % x.dim())


def scatter_to_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's slice of a replicated tensor along `dim` (entering a sequence-parallel region, e.g.
    after the embedding); backward all-gathers. Not a reduction: every rank holds the same `x`."""
    if _world(group) == 1:
        return x
    return _ScatterSeq.apply(x, group, dim % x.dim())


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        world, rank = _world(group), backend.get_rank(group)
        if x.shape[dim] % world:
            raise ValueError(f"sequence parallelism: dimension {dim} ({x.shape[dim]}) is not divisible by {world}")
        return x.chunk(world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.group, ctx.dim), None, None


class _ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks holding the same replica.

    Note [replica gradient sum]: a GQA kv head replicated on r ranks gets from each only the part of
    its gradient that rank's query heads produce. All tp ranks put their gradient into their replica's
    slot of a [slots, ...] buffer (zeros elsewhere) and all-reduce it: slot s then holds the sum over
    the ranks of replica s. One all-reduce over the existing tp group; no sub-groups to create.
    """

    @staticmethod
    def forward(ctx, w, group, slot, slots):
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.slots, *grad.shape))
        buf[ctx.slot] = grad
        backend.all_reduce(buf, group=ctx.group)
        return buf[ctx.slot].clone(), None, None, None


def sum_over_replicas(w: torch.Tensor, group, slot: int, slots: int) -> torch.Tensor:
    """`w` whose gradient is summed over the ranks sharing replica `slot` of `slots`; Note [replica
    gradient sum]."""
    return w if _world(group) == 1 else _ReplicaGradSum.apply(w, group, slot, slots)


def all_reduce_sequence_parallel_grads(params, group) -> None:
    """Sum the gradients of replicated parameters used inside a sequence-parallel region (LayerNorm
    weights see only this rank's slice of the sequence) over the tp group. Call after backward."""
    if _world(group) == 1:
        return
    for p in params:
        if p.grad is not None:
            backend.all_reduce(p.grad, group=group)
