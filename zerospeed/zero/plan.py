"""What ZeRO is asked to do, as small frozen values: the `ZeroPlan` and its `ReductionPolicy`.

The engine layer translates the validated config into these once (runtime/plans.py) and hands them to
`zero.build_strategy`; nothing in `zero/` reads the config. The values keep DeepSpeed's meanings (sizes
in elements, the configured ones; `budgets` are the sizes actually used, Note [buckets bounded by the
model] in budgets.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from zerospeed.offload.plan import OffloadPlan
from zerospeed.offload.zenflow import ZenFlowPlan
from zerospeed.zero.budgets import Budgets
from zerospeed.zero.grad_math import reduction_factors
from zerospeed.zero.stage3.zeropp import ZeroPPPolicy


@dataclass(frozen=True)
class ReductionPolicy:
    """How gradients cross ranks: in which dtype, with which scaling around the sum."""

    comm_dtype: torch.dtype | None = None
    """`communication_data_type`; None: each gradient buffer's own dtype."""
    op: str = "avg"
    """"sum" (`gradient_allreduce_op: sum`) or "avg": an average over the ranks a group reduces over."""
    prescale: bool = False
    predivide_factor: float = 1.0
    param_comm_dtypes: Mapping[int, torch.dtype] | None = field(default=None, compare=False)
    """id(parameter) -> dtype for the parameters `torch_autocast`'s safe modules own (Note [autocast
    gradient communication] in precision/autocast.py); None when autocast is off."""

    @property
    def scaling(self):
        """DeepSpeed's scaling rule around the sum, applied with each group's own size."""
        return functools.partial(
            reduction_factors, op=self.op, prescale=self.prescale, predivide_factor=self.predivide_factor
        )


@dataclass(frozen=True)
class LeafModulePlan:
    """`zero_optimization.leaf_module`: modules stage 3 gathers whole (Note [leaf modules])."""

    classes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ZeroPlan:
    """The ZeRO stage and its knobs, resolved once."""

    stage: int = 0
    reduction: ReductionPolicy = field(default_factory=ReductionPolicy)
    budgets: Budgets | None = None
    """The transient sizes used (stages 1-3); None: `reduce_bucket_size` as configured."""
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    sub_group_size: int = 1_000_000_000
    overlap_comm: bool = False
    ignore_unused_parameters: bool = True
    offload: OffloadPlan | None = None
    zenflow: ZenFlowPlan | None = None
    """`zero_optimization.zenflow` (stages 1-2 with the optimizer offloaded to the host): zero/zenflow.py."""
    # stage 3
    zeropp: ZeroPPPolicy = field(default_factory=ZeroPPPolicy)
    mics_shard_size: int = 0
    """> 0: MiCS shard groups of this many data-parallel ranks (Note [MiCS] in zero/strategy.py)."""
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    module_granularity_threshold: int = 0
    leaf_modules: LeafModulePlan | None = None
