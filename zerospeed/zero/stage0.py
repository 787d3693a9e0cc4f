"""ZeRO stage 0 as a strategy: replicated optimizer, bucketed gradient all-reduce (plain data parallel).

Each param group's parameters are laid out in flat fp32 (grad_accum_dtype) buffers of about
`reduce_bucket_size` elements, one `GradUnit` each; micro-batches accumulate there at full
precision, and on the boundary micro-step each buffer is all-reduced over its group while autograd
continues (`zero/reducer.py`); the all-reduce is settled before `backward` returns. Between a
backward and the next one (or the step) each parameter's `.grad` is its slot of the buffer (a view,
where the dtypes agree; Note [.grad as a slot view] in zero/reducer.py): the local accumulated
gradient before the boundary, the averaged one after it, as DeepSpeed's stage 0 shows it.
"""

from __future__ import annotations

import torch

from zerospeed.optim.sub_group_step import InMemoryStepper, step_in_sub_groups
from zerospeed.precision.master import MasterWeights
from zerospeed.zero import fragment
from zerospeed.zero.fragment import Held, ParamFragment
from zerospeed.zero.grad_math import global_norm
from zerospeed.zero.partition import build_layouts
from zerospeed.zero.reducer import GradientReducer, GradUnit, all_reduce_at_boundary
from zerospeed.zero.shards import Piece, ShardEntry
from zerospeed.zero.strategy import (
    ReducingStrategy,
    ReductionGroup,
    full_module_state,
    optimizer_state_bytes,
    weighted_global_norm,
)


class DataParallelStrategy(ReducingStrategy):
    stage = 0
    supports_no_sync = True
    weights_in_shards = False
    replicated_state = True

    def __init__(
        self,
        groups: list[dict],
        reduction: list[ReductionGroup],
        *,
        mixed: bool,
        bucket_size: int,
        accum_dtype: torch.dtype,
        comm_dtype: torch.dtype | None,
        scaling,
        norm_group=None,
        module: torch.nn.Module | None = None,
        param_comm_dtypes: dict | None = None,
    ):
        self.groups = groups
        self.module = module
        self.norm_group = norm_group
        params = [p for g in groups for p in g["params"]]
        self.master = MasterWeights(params, mixed=mixed)
        self.units = [
            unit
            for g, rg in zip(groups, reduction)
            for unit in _units(g["params"], rg, bucket_size, accum_dtype, param_comm_dtypes or {})
        ]
        self.reducer = GradientReducer(
            self.units,
            all_reduce_at_boundary(),
            scaling=scaling,
            comm_dtype=comm_dtype,
            param_comm_dtypes=param_comm_dtypes,
        )
        self.uniform_reduction = all(rg.group is norm_group for rg in reduction)
        self._grads = self.grads()  # the buffers are persistent: their views are too
        self._grad_of = {id(p): g for p, g in self._grads}
        fragment.claim(params, self)

    def optimizer_param_groups(self) -> list[dict]:
        return self.master.map_param_groups(self.groups)

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        self.master.retarget_optimizer(optimizer)

    def global_grad_norm(self) -> float:
        """Note [stage-0 local norm]: when every unit reduced over the norm group itself, each rank
        already holds the whole reduced gradient and its local norm is the global one (an inf or nan
        anywhere is everywhere after the all-reduce) — no collective needed. Otherwise (expert groups,
        or a boundary inside no_sync that reduced nothing) each rank's copy counts 1/world of its
        group in one weighted all-reduce (per parameter under Note [norm weights])."""
        if self.norm_weights is not None:
            return weighted_global_norm(self._weighted_parts(full=True), self.norm_group)
        if self.uniform_reduction and self.reducer.reduced:
            return global_norm([u.accum for u in self.units])
        return weighted_global_norm([(u.accum, 1.0 / u.world_size) for u in self.units], self.norm_group)

    def grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its gradient: a view of its unit's buffer) for every trainable parameter."""
        return [
            (u.params[s.param], u.accum[s.offset : s.offset + s.numel].view_as(u.params[s.param]))
            for u in self.units
            for s in u.layout.segments
        ]

    # -- .grad as a view of the buffer (Note [.grad as a slot view]) ------------------------------
    def begin_backward(self, sync: bool) -> None:
        self._hide_grads()  # autograd starts from None: the hooks add each fresh gradient once
        super().begin_backward(sync)

    def end_micro_step(self) -> None:
        super().end_micro_step()  # the boundary all-reduce completes first
        for p, g in self._grads:
            if g.dtype == p.dtype and g.device == p.device:  # a bf16 model with fp32 accumulation shows none
                p.grad = g

    def zero_grads(self) -> None:
        super().zero_grads()
        self._hide_grads()

    def _hide_grads(self) -> None:
        for p, g in self._grads:
            if p.grad is not None and p.grad.data_ptr() == g.data_ptr() and p.grad.dtype == g.dtype:
                p.grad = None

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        step_in_sub_groups(optimizer, [(self.master.master_of(p), g) for p, g in self._grads], coef)
        self.master.copy_to_model()

    # -- parameter accessors (Note [parameter fragments] in zero/fragment.py) ----------------------
    def param_fragment(self, param: torch.Tensor) -> ParamFragment | None:
        """Every rank holds the whole master and the whole (local, or after the boundary averaged) gradient."""
        grad = self._grad_of.get(id(param))
        if grad is None:
            return None
        n = param.numel()
        return ParamFragment(
            param.shape,
            param.device,
            Held(self.master.master_of(param), 0, 0, n),
            Held(grad, 0, 0, n) if self.has_grads() else None,
        )

    @torch.no_grad()
    def refresh_weights(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """The 16-bit weight from its just-written master (in fp32 the master is the weight itself)."""
        master = self.master.master_of(param)
        if master is not param:
            param.copy_(master)

    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        """Every master is a whole parameter, held identically by every rank."""
        return [
            ShardEntry(m, [Piece(names[id(p)], 0, 0, p.numel())])
            for p, m in zip(self.master.model_params, self.master.masters)
        ]

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

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Note [offloaded states] (offload/states.py): this rank's tensors of each kind."""
        return {
            "hp_params": list(self.master.masters),
            "lp_params": list(self.master.model_params),
            "lp_grads": [u.accum for u in self.units],
            "contiguous_grad_buffer": [u.staging for u in self.units if u.staging is not None],
        }

    def memory_breakdown(self, optimizer) -> dict[str, int]:
        params = sum(p.nbytes for p in self.master.model_params)
        masters = sum(m.nbytes for m in self.master.masters) if self.master.mixed else 0
        return {
            "parameters": params,
            "gradients": sum(u.accum.nbytes for u in self.units),
            "master_weights": masters,
            "optimizer_states": optimizer_state_bytes(optimizer),
        }


def _units(
    params: list[torch.nn.Parameter],
    rg: ReductionGroup,
    bucket_size: int,
    dtype: torch.dtype,
    comm_dtypes: dict[int, torch.dtype],
):
    # Backward visits layers roughly in reverse registration order: lay out in that order so the
    # first units fill (and launch) first.
    ordered = list(reversed(params))
    device = ordered[0].device if ordered else torch.device("cpu")
    units = []
    kinds = [comm_dtypes.get(id(p)) for p in ordered] if comm_dtypes else None
    for layout in build_layouts([p.numel() for p in ordered], bucket_size, world_size=1, kinds=kinds):
        accum = torch.zeros(layout.padded, dtype=dtype, device=device)
        units.append(GradUnit(ordered, layout, rg, result=accum, accum=accum))
    return units
