"""DeepSpeed's `runtime.utils.clip_grad_norm_`: clip gradients by a norm agreed over the data-parallel group.

For code that clips outside the engine (the engine clips with its own global norm, runtime/core.py). Each
rank takes the p-norm of its parameters' gradients (with an `mpu`: summed over the model-parallel group,
each replicated tensor counted once, by model-parallel rank 0; the inf-norm is the maximum there), then
the ranks of the data-parallel group average their norms: MoE expert gradients differ between ranks, so the
mean makes every rank clip by the same factor. The factor is torch's rule, min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import math

import torch

from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.parallel import groups


def is_model_parallel(p: torch.Tensor) -> bool:
    """A tensor-parallel shard (Megatron's `model_parallel` / `tensor_model_parallel` attribute)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their norm is at most `max_norm`; returns the
    norm (a 0-d tensor on the first parameter's device), the mean over the data-parallel group of `mesh`
    (None: the job's world) of each rank's norm (module docstring)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        raise ValueError("clip_grad_norm_: none of the parameters has a gradient")
    norm_type = float(norm_type)
    device = parameters[0].grad.device
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float().to(device) for p in parameters]).max()
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        counted = [p for p in parameters if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel(p)]
        norms = [torch.linalg.vector_norm(p.grad.detach().float(), norm_type).to(device) for p in counted]
        total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    comm.all_reduce(total, op=comm.ReduceOp.AVG, group=groups._get_data_parallel_group(mesh))
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total
