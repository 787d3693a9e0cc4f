"""ZeRO: sharding of optimizer states (stage 1), gradients (stage 2) and parameters (stage 3)."""
from __future__ import annotations

import torch

from zerospeed.zero.sharded import ShardedStrategy
from zerospeed.zero.stage0 import DataParallelStrategy
from zerospeed.zero.stage3 import GatheredParameters, Init, full_numel, full_shape, register_external_parameter
from zerospeed.zero.stage3.strategy import Stage3Strategy

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_strategy(cfg, groups: list[dict], *, module: torch.nn.Module, param_dtype: torch.dtype,
                   device: torch.device, dp_group=None):
    """The gradient / optimizer strategy for the configured ZeRO stage (resolved once, here)."""
    from zerospeed.offload.plan import OffloadPlan
    zero = cfg.zero_optimization
    plan = OffloadPlan.from_config(cfg, device)
    comm_dtype = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    grad_dtype = _DTYPES[cfg.data_types.grad_accum_dtype or "fp32"]
    common = dict(comm_dtype=comm_dtype, op="sum" if cfg.gradient_allreduce_op == "sum" else "avg",
                  prescale=cfg.prescale_gradients, predivide_factor=cfg.gradient_predivide_factor)
    if zero.stage == 0:
        return DataParallelStrategy(groups, mixed=param_dtype != torch.float32, group=dp_group,
                                    bucket_size=int(zero.reduce_bucket_size), accum_dtype=grad_dtype, **common)
    if zero.stage == 3:
        return Stage3Strategy(module, groups, param_dtype=param_dtype, device=device,
                              reduce_bucket_size=int(zero.reduce_bucket_size), sub_group_size=int(zero.sub_group_size),
                              overlap_comm=bool(zero.overlap_comm),
                              prefetch_bucket_size=int(zero.stage3_prefetch_bucket_size),
                              max_live_parameters=int(zero.stage3_max_live_parameters),
                              max_reuse_distance=int(zero.stage3_max_reuse_distance),
                              param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
                              model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
                              dp_group=dp_group, plan=plan, **common)
    return ShardedStrategy(groups, stage=zero.stage, param_dtype=param_dtype, device=device,
                           reduce_bucket_size=int(zero.reduce_bucket_size),
                           allgather_bucket_size=int(zero.allgather_bucket_size),
                           sub_group_size=int(zero.sub_group_size), overlap_comm=bool(zero.overlap_comm),
                           grad_dtype=grad_dtype, ignore_unused_parameters=zero.ignore_unused_parameters,
                           dp_group=dp_group, plan=plan, **common)


__all__ = ["DataParallelStrategy", "GatheredParameters", "Init", "ShardedStrategy", "Stage3Strategy", "build_strategy",
           "full_numel", "full_shape", "register_external_parameter"]
