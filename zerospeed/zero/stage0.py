"""ZeRO stage 0 as a strategy: replicated optimizer, bucketed gradient all-reduce (plain data parallel).

Each param group's parameters are laid out in flat fp32 (grad_accum_dtype) buffers of about
`reduce_bucket_size` elements, one `GradUnit` each; micro-batches accumulate there at full
precision, and on the boundary micro-step each buffer is all-reduced over its group while autograd
continues (`zero/reducer.py`).
"""
from __future__ import annotations

import torch

from zerospeed.optim.sub_group_step import InMemoryStepper, step_in_sub_groups
from zerospeed.precision.master import MasterWeights
from zerospeed.zero.grad_math import global_norm
from zerospeed.zero.partition import build_layouts
from zerospeed.zero.reducer import GradientReducer, GradUnit, all_reduce_at_boundary
from zerospeed.zero.shards import Piece, ShardEntry
from zerospeed.zero.strategy import (ReducingStrategy, ReductionGroup, full_module_state, optimizer_state_bytes,
                                     weighted_global_norm)


class DataParallelStrategy(ReducingStrategy):
    stage = 0
    supports_no_sync = True
    weights_in_shards = False
    replicated_state = True

    def __init__(self, groups: list[dict], reduction: list[ReductionGroup], *, mixed: bool, bucket_size: int,
                 accum_dtype: torch.dtype, comm_dtype: torch.dtype | None, scaling, norm_group=None,
                 module: torch.nn.Module | None = None):
        self.groups = groups
        self.module = module
        self.norm_group = norm_group
        params = [p for g in groups for p in g["params"]]
        self.master = MasterWeights(params, mixed=mixed)
        self.units = [unit for g, rg in zip(groups, reduction) for unit in _units(g["params"], rg, bucket_size,
                                                                                  accum_dtype)]
        self.reducer = GradientReducer(self.units, all_reduce_at_boundary(), scaling=scaling,
                                       comm_dtype=comm_dtype)
        self.uniform_reduction = all(rg.group is norm_group for rg in reduction)

    def optimizer_param_groups(self) -> list[dict]:
        return self.master.map_param_groups(self.groups)

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        self.master.retarget_optimizer(optimizer)

    def global_grad_norm(self) -> float:
        """Note [stage-0 local norm]: when every unit reduced over the norm group itself, each rank
        already holds the whole reduced gradient and its local norm is the global one (an inf or nan
        anywhere is everywhere after the all-reduce) — no collective needed. Otherwise (expert groups,
        or a boundary inside no_sync that reduced nothing) each rank's copy counts 1/world of its
        group in one weighted all-reduce."""
        if self.uniform_reduction and self.reducer.reduced:
            return global_norm([u.accum for u in self.units])
        return weighted_global_norm([(u.accum, 1.0 / u.world_size) for u in self.units], self.norm_group)

    def grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its gradient: a view of its unit's buffer) for every trainable parameter."""
        return [(u.params[s.param], u.accum[s.offset:s.offset + s.numel].view_as(u.params[s.param]))
                for u in self.units for s in u.layout.segments]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        step_in_sub_groups(optimizer, [(self.master.master_of(p), g) for p, g in self.grads()], coef)
        self.master.copy_to_model()

    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        """Every master is a whole parameter, held identically by every rank."""
        return [ShardEntry(m, [Piece(names[id(p)], 0, 0, p.numel())])
                for p, m in zip(self.master.model_params, self.master.masters)]

    def sync_params_from_masters(self) -> None:
        self.master.copy_to_model()

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        if self.master.mixed:
            torch._foreach_copy_(self.master.masters, self.master.model_params)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The module's own state dict: every rank holds the whole model."""
        return full_module_state(self.module, dtype)

    def resident(self, optimizer):
        """Masters and optimizer states are always in memory at stage 0."""
        return InMemoryStepper().resident(optimizer)

    def placement(self) -> dict[str, str]:
        where = str(next((p.device for g in self.optimizer_param_groups() for p in g["params"]), "none"))
        return {"parameters": where, "gradients": where, "master_weights": where, "optimizer_states": where}

    def swap_files(self) -> list:
        return []

    def close(self) -> None:
        pass

    def memory_breakdown(self, optimizer) -> dict[str, int]:
        params = sum(p.nbytes for p in self.master.model_params)
        masters = sum(m.nbytes for m in self.master.masters) if self.master.mixed else 0
        return {"parameters": params, "gradients": sum(u.accum.nbytes for u in self.units),
                "master_weights": masters, "optimizer_states": optimizer_state_bytes(optimizer)}


def _units(params: list[torch.nn.Parameter], rg: ReductionGroup, bucket_size: int, dtype: torch.dtype):
    # Backward visits layers roughly in reverse registration order: lay out in that order so the
    # first units fill (and launch) first.
    ordered = list(reversed(params))
    device = ordered[0].device if ordered else torch.device("cpu")
    units = []
    for layout in build_layouts([p.numel() for p in ordered], bucket_size, world_size=1):
        accum = torch.zeros(layout.padded, dtype=dtype, device=device)
        units.append(GradUnit(ordered, layout, rg, result=accum, accum=accum))
    return units

