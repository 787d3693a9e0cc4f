"""ZeRO: sharding of optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

`build_strategy` is the one place that reads the stage number (of the `ZeroPlan` the engine resolves
from the config once, zero/plan.py): it picks the strategy (stage 0 data parallel, 1, 2 = 1 +
reduce-scatter every micro-step, 3 = 2 + parameter lifecycle) and gives it one `ReductionGroup` per
param group from the parallel mesh (Note [reduction groups] in zero/strategy.py). Everything after
talks to the `ZeroStrategy` protocol.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from zerospeed.precision.policy import PrecisionPolicy
from zerospeed.zero.leaf_modules import apply_leaf_module_config, set_z3_leaf_modules_by_threshold
from zerospeed.zero.plan import LeafModulePlan, ReductionPolicy, ZeroPlan
from zerospeed.zero.sharded import ShardedStrategy, Stage2Strategy
from zerospeed.zero.stage0 import DataParallelStrategy
from zerospeed.zero.stage3 import GatheredParameters, Init, full_numel, full_shape, register_external_parameter
from zerospeed.zero.stage3.strategy import Stage3Strategy
from zerospeed.zero.stage3.tiling import TiledLinear, TiledLinearReturnBias
from zerospeed.zero.strategy import ReductionGroup, ZeroStrategy, reduction_groups
from zerospeed.zero.zenflow import ZenFlowStage1, ZenFlowStage2, ZenFlowStage3


def build_strategy(
    plan: ZeroPlan,
    groups: list[dict],
    reduction: list[ReductionGroup],
    *,
    module: torch.nn.Module,
    precision: PrecisionPolicy,
    device: torch.device,
    norm_group=None,
) -> ZeroStrategy:
    """The gradient / optimizer strategy for the plan's ZeRO stage (resolved once, here), with each param
    group reducing over its `ReductionGroup` and the gradient norm over `norm_group`; the precision
    policy's `grad_accum_dtype` is where gradients accumulate."""
    red = plan.reduction
    common = dict(
        comm_dtype=red.comm_dtype,
        scaling=red.scaling,
        norm_group=norm_group,
        param_comm_dtypes=red.param_comm_dtypes or None,
    )  # `torch_autocast`'s safe modules
    param_dtype, grad_dtype = precision.param_dtype, precision.grad_accum_dtype
    if plan.stage == 0:
        return DataParallelStrategy(
            groups,
            reduction,
            mixed=param_dtype != torch.float32,
            module=module,
            bucket_size=plan.reduce_bucket_size,
            accum_dtype=grad_dtype,
            **common,
        )
    budgets, offload, zenflow = plan.budgets, plan.offload, plan.zenflow
    if zenflow is not None:  # Note [the ZenFlow step] (zero/zenflow.py): its own host step and overlap
        offload = dataclasses.replace(offload, overlap_step=False, early_step=False)
    if plan.stage == 3:  # Note [leaf modules] (zero/stage3/strategy.py): the config's leaves, then the threshold's
        apply_leaf_module_config(module, plan.leaf_modules)
        set_z3_leaf_modules_by_threshold(module, plan.module_granularity_threshold)
        # Note [ZenFlow at stage 3] (zero/zenflow.py)
        cls3 = Stage3Strategy if zenflow is None else functools.partial(ZenFlowStage3, zenflow=zenflow)
        return cls3(
            module,
            groups,
            reduction,
            param_dtype=param_dtype,
            device=device,
            reduce_bucket_size=budgets.reduce_bucket,
            sub_group_size=plan.sub_group_size,
            overlap_comm=plan.overlap_comm,
            prefetch_bucket_size=budgets.prefetch_bucket,
            max_live_parameters=plan.max_live_parameters,
            max_reuse_distance=budgets.reuse_distance,
            param_persistence_threshold=plan.param_persistence_threshold,
            model_persistence_threshold=plan.model_persistence_threshold,
            plan=offload,
            zeropp=plan.zeropp,
            master_dtype=precision.master_dtype,
            grad_dtype=grad_dtype,
            **common,
        )
    cls = ShardedStrategy if plan.stage == 1 else Stage2Strategy
    if zenflow is not None:
        cls = functools.partial(ZenFlowStage1 if plan.stage == 1 else ZenFlowStage2, zenflow=zenflow)
    return cls(
        groups,
        reduction,
        param_dtype=param_dtype,
        device=device,
        module=module,
        reduce_bucket_size=budgets.reduce_bucket,
        allgather_bucket_size=plan.allgather_bucket_size,
        sub_group_size=plan.sub_group_size,
        overlap_comm=plan.overlap_comm,
        grad_dtype=grad_dtype,
        ignore_unused_parameters=plan.ignore_unused_parameters,
        plan=offload,
        master_dtype=precision.master_dtype,
        **common,
    )


__all__ = [
    "DataParallelStrategy",
    "GatheredParameters",
    "Init",
    "LeafModulePlan",
    "ReductionGroup",
    "ReductionPolicy",
    "ShardedStrategy",
    "Stage2Strategy",
    "Stage3Strategy",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroPlan",
    "ZeroStrategy",
    "build_strategy",
    "full_numel",
    "full_shape",
    "reduction_groups",
    "register_external_parameter",
]
