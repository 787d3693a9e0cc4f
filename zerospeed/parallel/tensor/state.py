"""What a tensor-parallel model's parameters are: sharded (and how) or replicated, and how to put the
full model back together.

`param_layouts(model)` is the contract for the rest of zerospeed (engine, ZeRO, checkpoints): for each
unique parameter name, the per-rank ShardSpecs of a sharded parameter, or None for one replicated on
every tp rank. `replica_counts` gives how many tp ranks hold each parameter's exact values, so a global
gradient norm counts replicated parameters (LayerNorm, row biases, shared GQA kv heads) once:

    ||g||^2 = all_reduce_tp( sum_p ||g_p||^2 / replicas_p )
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.checkpoint.protocols import full_model_state
from zerospeed.comm import backend
from zerospeed.parallel.tensor.layers import Specs, TensorParallelModule, gather_full  # noqa: F401 (re-exported)


def param_layouts(model: nn.Module) -> dict[str, Specs | None]:
    """{parameter name: per-rank layouts, or None when replicated}, for the names `named_parameters()`
    yields (a tied weight appears once, under its first name)."""
    owners: dict[int, Specs | None] = {}
    for module in model.modules():
        if isinstance(module, TensorParallelModule):
            for local, specs in module.shard_specs.items():
                p = getattr(module, local)
                if p is not None:
                    owners[id(p)] = specs
    return {name: owners.get(id(p)) for name, p in model.named_parameters()}


def replica_counts(model: nn.Module, tp_size: int) -> dict[str, int]:
    """{parameter name: number of tp ranks holding identical values} (tp_size for replicated ones)."""
    out = {}
    for name, specs in param_layouts(model).items():
        out[name] = tp_size if specs is None else specs[0].replicas
    return out


def grad_norm_squared(model: nn.Module, group) -> torch.Tensor:
    """The squared L2 norm of the full model's gradient, from this rank's shards (one all-reduce over
    the tp group); every parameter of the full model counted exactly once."""
    tp = backend.get_world_size(group)
    counts = replica_counts(model, tp)
    total = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum().cpu() / counts[name]
    backend.all_reduce(total, group=group)
    return total


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at its full size and in the layout of the model before sharding
    (transformers Conv1D weights transposed back to [in, out]); tied weights under each of their names.
    Collective: every rank of the tp group must call it. Each layer gathers over its own tp group
    (`group`, the same group, is accepted for the callers that name it); the checkpoint's
    `full_model_state` does the walk (each layer answers the `TensorParallelLayer` protocol)."""
    return full_model_state(model)


def transposed_params(model: nn.Module) -> set[str]:
    """Names (as `named_parameters()` yields them) of the weights whose full tensor in `full_state_dict` is
    the transpose of the sharded layer's [out, in] layout: transformers Conv1D weights, [in, out]."""
    ids = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, TensorParallelModule) and m.source_transposed and getattr(m, "weight", None) is not None
    }
    return {name for name, p in model.named_parameters() if id(p) in ids}
