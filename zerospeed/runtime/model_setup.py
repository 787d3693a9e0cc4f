"""What the engine does to the model once, at set-up: start every rank from the same weights, weight the
gradient norm of tensor-parallel replicas, and record the trained parameters' names and sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed import comm
from zerospeed.parallel.clipping import is_model_parallel
from zerospeed.parallel.tensor.layers import TensorParallelModule
from zerospeed.parallel.tensor.state import replica_counts
from zerospeed.zero import full_numel


@torch.no_grad()
def broadcast_model(module: torch.nn.Module, param_groups: list[dict], reduction, dp_group) -> None:
    """Start every rank from rank 0's weights and buffers, as DeepSpeed does: each trainable parameter
    from rank 0 of the group it reduces over (experts differ across expert groups)."""
    done = set()
    for g, rg in zip(param_groups, reduction):
        for p in g["params"]:  # (MiCS: a shard group's replicas start from rank 0 too)
            _broadcast_from_first(p.data, rg.group if rg.replicas == 1 else dp_group)
            done.add(id(p))
    rest = [p for p in module.parameters() if id(p) not in done] + list(module.buffers())
    for t in rest:
        _broadcast_from_first(t.data, dp_group)


def _broadcast_from_first(t: torch.Tensor, group) -> None:
    """Rank 0 of `group`'s values into `t` on every rank. NCCL refuses non-contiguous tensors (a
    buffer made by `expand`, like transformers' position_ids, even has stride 0): those travel as a
    contiguous copy, written back where the tensor owns its elements."""
    if comm.get_world_size(group) <= 1 or t.numel() == 0:
        return
    if t.is_contiguous():
        comm.broadcast(t, src=comm.global_rank(group, 0), group=group)
        return
    buf = t.contiguous()
    comm.broadcast(buf, src=comm.global_rank(group, 0), group=group)
    if 0 not in t.stride():
        t.copy_(buf)


@torch.no_grad()
def cast_model(module: torch.nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype | None = None) -> None:
    """The 16-bit cast at set-up: floating parameters to `param_dtype`, floating buffers to `buffer_dtype`
    (`data_types.buffer_dtype`) or, without it, to `param_dtype` too (`module.to(param_dtype)`)."""
    keep = {}
    if buffer_dtype is not None and buffer_dtype != param_dtype:  # taken before the cast: no round trip
        keep = {(id(sub), n): b for sub in module.modules() for n, b in sub._buffers.items() if _floating(b)}
    module.to(param_dtype)
    for sub in module.modules():
        for name in sub._buffers:
            if (id(sub), name) in keep:
                sub._buffers[name] = keep[(id(sub), name)].to(buffer_dtype)


def _floating(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_floating_point()


def weight_tensor_parallel_norm(module: torch.nn.Module, zero, mesh) -> None:
    """Note [norm weights] (zero/strategy.py): the gradient norm spans the tensor-parallel ranks, a
    parameter held by r of them counting 1/r on each. zerospeed's own tensor-parallel layers (AutoTP,
    zerospeed.parallel.tensor) know which parameters are replicated; a model parallelised by its own code
    (with an mpu) says it as Megatron does, `tensor_model_parallel` (or `model_parallel`) = True on each split
    parameter, the others counted once over the tp ranks, as DeepSpeed's norm reads them; without any such
    mark it keeps the per-rank norm."""
    tp = mesh.size("tp")
    if tp <= 1:
        return
    if any(isinstance(m, TensorParallelModule) for m in module.modules()):
        counts = replica_counts(module, tp)
        weights = {id(p): 1.0 / counts[name] for name, p in module.named_parameters()}
    elif any(is_model_parallel(p) for p in module.parameters()):
        weights = {id(p): 1.0 if is_model_parallel(p) else 1.0 / tp for p in module.parameters()}
    else:
        return
    zero.set_norm_weights(weights, mesh.group("world"))


def param_group_names(module: torch.nn.Module, param_groups: list[dict]) -> list[list[str]]:
    """The trained parameters' names per param group, in order (a DeepSpeed ZeRO-0 checkpoint's optimizer
    states are indexed by that position: Note [DeepSpeed checkpoints] in checkpoint/deepspeed_import.py)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names.get(id(p), "") for p in g["params"]] for g in param_groups]


@dataclass(frozen=True)
class TrainedSizes:
    """What the memory formula needs of the model, counted before ZeRO partitions it."""

    groups: tuple[tuple[int, int], ...]
    """Per param group: (its elements, the ranks it shards over: its reduction group — dense weights over
    data x sequence ranks, experts over expert-dp)."""
    frozen_numel: int
    """Elements of the parameters outside every group (stage 3 partitions them too)."""

    @classmethod
    def of(cls, module: torch.nn.Module, param_groups: list[dict], reduction) -> TrainedSizes:
        trained = {id(p) for g in param_groups for p in g["params"]}
        return cls(
            tuple((sum(full_numel(p) for p in g["params"]), rg.world_size) for g, rg in zip(param_groups, reduction)),
            sum(full_numel(p) for p in module.parameters() if id(p) not in trained),
        )
