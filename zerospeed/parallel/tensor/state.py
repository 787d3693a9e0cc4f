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

from zerospeed.comm import backend
from zerospeed.parallel.tensor.layers import Specs, TensorParallelModule
from zerospeed.parallel.tensor.partition import assemble


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


def gather_full(local: torch.Tensor, specs: Specs | None, group) -> torch.Tensor:
    """The full tensor from every rank's `local` piece (collective over the tp group)."""
    if specs is None:
        return local.detach().clone()
    tp = backend.get_world_size(group)
    width = max(s.local_size for s in specs)
    dim = specs[0].dim
    piece = local.detach().movedim(dim, 0)
    padded = piece.new_zeros((width, *piece.shape[1:]))
    padded[:piece.shape[0]] = piece
    out = padded.new_empty((tp, *padded.shape))
    backend.all_gather_into_tensor(out, padded.contiguous().view(-1), group=group)  # flat: see mappings.py
    pieces = [out[r, :specs[r].local_size].movedim(0, dim) for r in range(tp)]
    return assemble(pieces, list(specs))


def full_state_dict(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at its full size and in the layout of the model before sharding
    (transformers Conv1D weights transposed back to [in, out]); tied weights under each of their names.
    Collective: every rank of the tp group must call it."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{local}" if mod_name else local
            if id(p) not in done:
                specs = module.shard_specs.get(local) if isinstance(module, TensorParallelModule) else None
                full = gather_full(p, specs, group)
                if isinstance(module, TensorParallelModule) and module.source_transposed and local == "weight":
                    full = full.t().contiguous()
                done[id(p)] = full
            out[name] = done[id(p)]
    for name, value in model.state_dict(keep_vars=True).items():  # persistent buffers, as state_dict has them
        if name not in out:
            out[name] = value.detach().clone()
    return out


def transposed_params(model: nn.Module) -> set[str]:
    """Names (as `named_parameters()` yields them) of the weights whose full tensor in `full_state_dict` is
    the transpose of the sharded layer's [out, in] layout: transformers Conv1D weights, [in, out]."""
    ids = {id(m.weight) for m in model.modules()
           if isinstance(m, TensorParallelModule) and m.source_transposed and getattr(m, "weight", None) is not None}
    return {name for name, p in model.named_parameters() if id(p) in ids}
