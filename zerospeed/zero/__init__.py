"""ZeRO: sharding of optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

`build_strategy` is the one place that reads the stage number: it picks the strategy (stage 0
data parallel, 1, 2 = 1 + reduce-scatter every micro-step, 3 = 2 + parameter lifecycle) and gives
it one `ReductionGroup` per param group from the parallel mesh (Note [reduction groups] in
zero/strategy.py). Everything after talks to the `ZeroStrategy` protocol.
"""
from __future__ import annotations

import functools

import torch

from zerospeed.offload.plan import OffloadPlan
from zerospeed.precision.autocast import param_comm_dtypes
from zerospeed.zero.budgets import bounded_budgets
from zerospeed.zero.grad_math import reduction_factors
from zerospeed.zero.sharded import ShardedStrategy, Stage2Strategy
from zerospeed.zero.stage0 import DataParallelStrategy
from zerospeed.zero.stage3 import GatheredParameters, Init, full_numel, full_shape, register_external_parameter
from zerospeed.zero.stage3.strategy import Stage3Strategy
from zerospeed.zero.stage3.zeropp import ZeroPPPolicy
from zerospeed.zero.strategy import ReductionGroup, ZeroStrategy, reduction_groups

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_strategy(cfg, groups: list[dict], reduction: list[ReductionGroup], *, module: torch.nn.Module,
                   param_dtype: torch.dtype, device: torch.device, norm_group=None,
                   master_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype = torch.float32) -> ZeroStrategy:
    """The gradient / optimizer strategy for the configured ZeRO stage (resolved once, here), with
    each param group reducing over its `ReductionGroup` and the gradient norm over `norm_group`;
    `grad_dtype` (the precision policy's `grad_accum_dtype`) is where gradients accumulate."""
    zero = cfg.zero_optimization
    comm_dtype = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    # DeepSpeed's scaling rule around the sum, applied with each group's own size (an average over
    # the ranks that group reduces over)
    scaling = functools.partial(reduction_factors, op="sum" if cfg.gradient_allreduce_op == "sum" else "avg",
                                prescale=cfg.prescale_gradients, predivide_factor=cfg.gradient_predivide_factor)
    common = dict(comm_dtype=comm_dtype, scaling=scaling, norm_group=norm_group,
                  param_comm_dtypes=param_comm_dtypes(module, cfg) or None)  # `torch_autocast`'s safe modules
    plan = OffloadPlan.from_config(cfg, device)  # also refuses offload keys the stage cannot honour
    zeropp = ZeroPPPolicy.from_config(zero, getattr(plan, "param", "none"))  # refuses ZeRO++ below stage 3
    # Note [buckets bounded by the model] (zero/budgets.py): DeepSpeed's sizes as upper bounds
    budgets = bounded_budgets(sum(full_numel(p) for g in groups for p in g["params"]),
                              reduce_bucket_size=int(zero.reduce_bucket_size),
                              prefetch_bucket_size=int(zero.stage3_prefetch_bucket_size),
                              max_reuse_distance=int(zero.stage3_max_reuse_distance),
                              gathered_elements=sum(full_numel(p) for p in module.parameters()))
    if zero.stage == 0:
        return DataParallelStrategy(groups, reduction, mixed=param_dtype != torch.float32, module=module,
                                    bucket_size=int(zero.reduce_bucket_size), accum_dtype=grad_dtype, **common)
    if zero.stage == 3:  # Note [leaf modules] (zero/stage3/strategy.py): the config's leaves, then the threshold's
        from zerospeed.zero.leaf_modules import apply_leaf_module_config, set_z3_leaf_modules_by_threshold
        apply_leaf_module_config(module, zero.leaf_module)
        set_z3_leaf_modules_by_threshold(module, int(zero.stage3_module_granularity_threshold))
        return Stage3Strategy(module, groups, reduction, param_dtype=param_dtype, device=device,
                              reduce_bucket_size=budgets.reduce_bucket, sub_group_size=int(zero.sub_group_size),
                              overlap_comm=bool(zero.overlap_comm), prefetch_bucket_size=budgets.prefetch_bucket,
                              max_live_parameters=int(zero.stage3_max_live_parameters),
                              max_reuse_distance=budgets.reuse_distance,
                              param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
                              model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
                              plan=plan, zeropp=zeropp, master_dtype=master_dtype, grad_dtype=grad_dtype, **common)
    cls = ShardedStrategy if zero.stage == 1 else Stage2Strategy
    return cls(groups, reduction, param_dtype=param_dtype, device=device, module=module,
               reduce_bucket_size=budgets.reduce_bucket, allgather_bucket_size=int(zero.allgather_bucket_size),
               sub_group_size=int(zero.sub_group_size), overlap_comm=bool(zero.overlap_comm), grad_dtype=grad_dtype,
               ignore_unused_parameters=zero.ignore_unused_parameters, plan=plan, master_dtype=master_dtype, **common)


__all__ = ["DataParallelStrategy", "GatheredParameters", "Init", "ReductionGroup", "reduction_groups", "ShardedStrategy", "Stage2Strategy",
           "Stage3Strategy", "ZeroStrategy", "build_strategy", "full_numel", "full_shape", "register_external_parameter"]
