"""Refusing to save a model split over the tensor-parallel ranks by its own code.

Note [hand-split parameters]: zerospeed's checkpoints save a parameter without a tensor-parallel shard layout (the
`TensorParallelLayer` protocol) as replicated: tp rank 0's copy is written as the whole tensor. A Megatron-style
layer written by hand (its own column/row split, e.g. for a DeepSpeed `mpu` run) holds a different piece on every
tp rank, so its save would silently lose the other ranks' pieces. Before anything is written the tp ranks compare
two numbers per such parameter (the sum and the absolute sum of the elements they hold) and every rank refuses
alike if one differs. Used by the data-parallel engine's save (ZeRO's masters: the elements each rank holds of
every parameter, at any stage) and the pipeline engine's (the layers' parameters).
"""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.checkpoint.errors import CheckpointError


def check_replicated(named: list[tuple[str, list[torch.Tensor]]], group, size: int, dp_group=None) -> None:
    """Note [hand-split parameters]: `named`, the same names in the same order on every tp rank, each with the
    tensors (pieces) this rank holds of it. Collective over the tp `group` of `size` ranks (and first over
    `dp_group`, whose ranks' pieces are summed: a ZeRO partition may cut a parameter differently on two tp ranks)."""
    if size == 1 or not named:
        return
    zero = torch.zeros((), dtype=torch.float64)
    rows = [  # (on the tensors' device; one copy to the host at the end)
        torch.stack(
            [
                sum((t.detach().double().sum() for t in ts), zero.to(ts[0].device) if ts else zero),
                sum((t.detach().double().abs().sum() for t in ts), zero.to(ts[0].device) if ts else zero),
            ]
        ).cpu()
        for _, ts in named
    ]
    mine = torch.stack(rows)
    if dp_group is not None:
        mine = sum(comm.all_gather_object(mine, group=dp_group))
    parts = comm.all_gather_object(mine, group=group)
    for i, (name, _) in enumerate(named):
        for r in range(1, size):
            if ((parts[r][i] - parts[0][i]).abs() > 1e-5 * parts[0][i][1] + 1e-6).any():  # (relative to the |sum|)
                raise CheckpointError(
                    f"save_checkpoint: parameter {name!r} has no tensor-parallel layout but differs between tp "
                    f"rank 0 and tp rank {r} (|sum| {parts[0][i][0].item():.6g} vs {parts[r][i][0].item():.6g}): "
                    "it is split by hand, and zerospeed would save tp rank 0's piece as the whole tensor. Build "
                    "the layer from zerospeed.parallel.tensor's ColumnParallelLinear / RowParallelLinear / "
                    "VocabParallelEmbedding, whose layouts the checkpoint records."
                )


def check_engine_replicated(state, names, place) -> None:
    """Note [hand-split parameters] for a data-parallel engine at tp > 1: the elements of every trainable parameter
    without a shard layout that this rank's ZeRO masters hold, summed over the data-parallel ranks."""
    if place.tp == 1:
        return
    order = sorted({n for n in names.params.values() if n not in place.layouts})
    held: dict[str, list[torch.Tensor]] = {n: [] for n in order}
    with state.zero.resident(state.optimizer):
        for entry in state.zero.shard_entries(names.params):
            for p in entry.pieces:
                if p.name in held:
                    held[p.name].append(entry.master.reshape(-1)[p.offset : p.offset + p.numel])
        check_replicated([(n, held[n]) for n in order], state.mesh.group("tp"), place.tp, state.mesh.group("dp_sp"))
