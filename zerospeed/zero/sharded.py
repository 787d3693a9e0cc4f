"""ZeRO stages 1 and 2 — and the sharded-optimizer base that stage 3 builds on.

`ShardedOptimizerBase` is what stages 1-3 share: this rank holds fp32 masters, optimizer states and
reduced gradients only for its chunks (one `GradUnit` per chunk-owning flat layout), steps them in
sub-groups through a stepper (in memory, or NVMe swap files), publishes the updated masters into
the parameters, and computes the exact global gradient norm from the chunks.

Stage 1 accumulates full gradients locally (one persistent flat buffer per layout, like stage 0)
and, on the micro-step that ends the accumulation window, reduce-scatters each layout as soon as
backward has filled it: rank r keeps the reduced chunk r in place. Stage 2 is stage 1 with the
reduce-scatter on *every* micro-step: a layout's gradients are staged in a transient buffer,
reduce-scattered, and added to this rank's persistent fp32 gradient chunk — full gradients never
outlive their bucket. Either way each layout's updated chunk is then all-gathered back into the
model's parameter buffer. The reduction itself is `zero/reducer.py`.

Note [local gradients]: a step can also come with gradients nobody reduced — a boundary inside
`no_sync()`, or the compressed stage of 1-bit Adam, which turns the engine's backward all-reduce off
and exchanges the momentum itself (runtime/fp16/onebit/). Each rank then holds its whole *local*
gradient in the units' full buffers: stage 1's persistent ones, or at stage 2 full buffers that
`hold_local_gradients(True)` allocates while the optimizer asks for it (ZeRO-2's gradient saving
is suspended for that stage: a 1-bit momentum needs every rank's whole gradient). The norm is then
taken over the full buffers, each rank's copy counting 1/world as stage 0 counts an unreduced one,
and the step's coefficient scales the whole buffer, which is what the optimizer reads.
"""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.offload.plan import make_stepper
from zerospeed.optim.muon import ShardedLayout
from zerospeed.optim.sub_group_step import OverlappedStepper, steps_locally
from zerospeed.zero import fragment
from zerospeed.zero.flat_group import FlatParamGroup
from zerospeed.zero.fragment import Held, ParamFragment
from zerospeed.zero.partition import group_sub_groups
from zerospeed.zero.reducer import (
    GradientReducer,
    GradUnit,
    ReductionPolicy,
    reduce_scatter_at_boundary,
    reduce_scatter_every_micro_step,
)
from zerospeed.zero.shards import Piece, ShardEntry
from zerospeed.zero.strategy import (
    ReducingStrategy,
    ReductionGroup,
    full_module_state,
    optimizer_state_bytes,
    state_placement,
    weighted_global_norm,
)


class ShardedOptimizerBase(ReducingStrategy):
    """Stages 1-3: per-chunk masters, optimizer states and gradients (see the module docstring).

    A subclass sets `self.units` (one per chunk), `self.masters` (aligned with them), `self.plan`,
    `self.device` and `self.norm_group`, then calls `_finish_setup`; it provides `_publish(indices)`
    (updated masters into the parameters), `_after_step()` (refresh what the model computes with) and
    `refresh_weights` (one parameter's, after its master was written through its fragment)."""

    weights_in_shards = False
    replicated_state = False

    def _finish_setup(
        self,
        policy: ReductionPolicy,
        *,
        sub_group_size: int,
        scaling,
        comm_dtype,
        ignore_unused: bool = True,
        on_unit_ready=None,
        launch_order=None,
        param_comm_dtypes: dict | None = None,
    ) -> None:
        self.uniform_reduction = all(u.group is self.norm_group for u in self.units)
        self.sub_groups = group_sub_groups([u.layout.chunk for u in self.units], sub_group_size)
        # swap files are named by the global rank: group ranks repeat across groups
        self.stepper = make_stepper(self.plan, self.masters, self.sub_groups, comm.get_rank())
        # Note [overlapped step]: the stepper that may start sub-groups during the boundary backward
        early = isinstance(self.stepper, OverlappedStepper) and self.plan.early_step and self.stepper.may_start_early
        self._early = self.stepper if early else None
        launch = launch_order or self.units
        self.reducer = GradientReducer(
            launch,
            policy,
            scaling=scaling,
            comm_dtype=comm_dtype,
            ignore_unused=ignore_unused,
            on_unit_ready=on_unit_ready,
            param_comm_dtypes=param_comm_dtypes,
            on_delivered=self._delivered if early else None,
        )
        # reduction unit -> the chunk its result lands in (stage 3's tied uses add into their owner's);
        # per chunk, how many units land there
        chunk_of = {id(u.result): k for k, u in enumerate(self.units)}
        self._chunk_of_unit = {id(u): chunk_of[id(u.result)] for u in launch}
        self._deliveries = [0] * len(self.units)
        for u in launch:
            self._deliveries[self._chunk_of_unit[id(u)]] += 1
        # id(parameter) -> (index of its unit, its segment there): Note [parameter fragments]
        self._where = {id(u.params[s.param]): (k, s) for k, u in enumerate(self.units) for s in u.layout.segments}
        fragment.claim([u.params[s.param] for u in self.units for s in u.layout.segments], self)

    # -- parameter accessors (Note [parameter fragments] in zero/fragment.py) ----------------------
    def param_fragment(self, param: torch.Tensor) -> ParamFragment | None:
        """This rank's piece of the parameter inside its chunk of the unit's layout (possibly none).
        The gradient is that chunk's reduced one — or, at stage 1 before the boundary reduction, the
        whole locally accumulated gradient, which every rank then holds for itself."""
        where = self._where.get(id(param))
        if where is None:
            return None
        if self._early is not None:  # no host step runs while a caller reads or writes a master
            self._early.wait()
        elif self.plan is not None and self.plan.delayed_update:  # Note [delayed parameter update]
            self.stepper.wait()
        k, seg = where
        u = self.units[k]
        ranks = ReductionGroup(u.group, u.world_size, u.rank)
        piece = next((p for p in u.layout.rank_segments(u.rank) if p.param == seg.param), None)
        master = (
            Held(self.masters[k], piece.offset, piece.param_offset, piece.numel, ranks)
            if piece is not None
            else Held(self.masters[k], 0, 0, 0, ranks)
        )
        if not self.has_grads():
            grad = None
        elif u.accum is not None and not self.reducer.reduced:
            grad = Held(u.accum, seg.offset, 0, seg.numel)
        else:
            grad = master.on(u.result)
        return ParamFragment(self._full_shape(param), self.device, master, grad)

    def _full_shape(self, param: torch.Tensor) -> torch.Size:
        return param.shape

    # -- reduction (the rest is ReducingStrategy's) ----------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Note [overlapped step]: a boundary backward arms the early start of the host step."""
        super().begin_backward(sync)
        if self._early is None:
            return
        optimizer = self.bound_optimizer
        if sync and not self.reducer.hold_local and steps_locally(optimizer):
            self._early.arm(optimizer, self._pairs(), self._deliveries)
        else:
            self._early.disarm()

    def _delivered(self, unit: GradUnit) -> None:
        self._early.ready(self._chunk_of_unit[id(unit)])

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(m, u.result) for m, u in zip(self.masters, self.units)]

    def zero_grads(self) -> None:
        if self._early is not None:
            self._early.discard()
        super().zero_grads()

    def global_grad_norm(self) -> float:
        """L2 norm of the full reduced gradient: each chunk once (Note [reduction groups]), each parameter
        by its weight (Note [norm weights]); of unreduced ones by Note [local gradients]."""
        local = self.local_gradients()
        if self.norm_weights is not None:
            return weighted_global_norm(self._weighted_parts(full=local), self.norm_group)
        if local:
            return weighted_global_norm([(u.accum, 1.0 / u.world_size) for u in self.units], self.norm_group)
        # Note [MiCS]: a chunk held by R replicas counts 1/R on each
        return weighted_global_norm([(u.result, 1.0 / u.replicas) for u in self.units], self.norm_group)

    def local_gradients(self) -> bool:
        """Note [local gradients]: this step's gradients are every rank's own, whole, in `u.accum`."""
        return not self.reducer.reduced and bool(self.units) and all(u.accum is not None for u in self.units)

    def local_gradient_units(self) -> list[tuple[torch.Tensor, GradUnit]]:
        """(master, its unit) pairs: where an optimizer that reduces for itself finds, for each master
        chunk, the whole layout's local gradient (`unit.accum`) and the chunk's place in it."""
        return list(zip(self.masters, self.units))

    def hold_local_gradients(self, on: bool) -> None:
        """Note [local gradients]: from the next backward, accumulate without any reduction."""
        self.reducer.hold_local = on

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        """Scale gradients by `coef`, step the optimizer over each sub-group, refresh parameters."""
        if self.local_gradients():  # Note [local gradients]: the whole buffers (stage 1's chunks are views)
            if coef != 1.0:
                for u in self.units:
                    u.accum.mul_(coef)
            coef = 1.0
        self.stepper.step(optimizer, self._pairs(), coef, self.sub_groups, on_stepped=self._publish)
        self._after_step()

    def transform_gradients(self, optimizer: torch.optim.Optimizer, scale: float) -> bool:
        """Note [Muon on ZeRO shards] (optim/muon.py): an optimizer that needs whole matrices turns the
        reduced gradient chunks into its update chunks here, after the overflow check and before the
        norm, which the engine then takes (and clips) over the update, as DeepSpeed's ZeRO 1-3 do."""
        if not hasattr(optimizer, "orthogonalize_shards"):
            return False
        if self.local_gradients():
            raise RuntimeError("Muon needs reduced gradients: a boundary inside no_sync() cannot step it")
        optimizer.orthogonalize_shards(self._sharded_layouts(), scale)
        return True

    def _sharded_layouts(self) -> list[ShardedLayout]:
        """Each chunk with what an optimizer needs to rebuild its layout's whole tensors."""
        return [
            ShardedLayout(
                master,
                u.result,
                [(self._full_shape(u.params[s.param]), s.offset, s.numel) for s in u.layout.segments],
                u.layout.chunk_range(u.rank)[0],
                lambda chunk, u=u: self._gather_layout(u, chunk),
            )
            for master, u in zip(self.masters, self.units)
        ]

    def _gather_layout(self, u: GradUnit, chunk: torch.Tensor) -> torch.Tensor:
        """Every rank's `chunk` of the unit's layout, whole, on the compute device."""
        full = torch.empty(u.layout.padded, dtype=chunk.dtype, device=self.device)
        comm.all_gather_into_tensor(full, chunk.to(self.device), group=u.group)
        return full

    def resident(self, optimizer):
        """Context in which every master and optimizer state is in memory (checkpoint save/load)."""
        return self.stepper.resident(optimizer)

    def swap_files(self) -> list:
        """(kind, path, bytes) of every NVMe swap file this rank owns."""
        return self.stepper.files()

    def close(self) -> None:
        """Remove the swap files (also done at exit)."""
        self.stepper.close()


class ShardedStrategy(ShardedOptimizerBase):
    """ZeRO stage 1: optimizer states sharded; gradients reduce-scattered at the accumulation boundary."""

    stage = 1
    supports_no_sync = True

    def __init__(
        self,
        groups: list[dict],
        reduction: list[ReductionGroup],
        *,
        param_dtype: torch.dtype,
        device: torch.device,
        reduce_bucket_size: int,
        allgather_bucket_size: int,
        sub_group_size: int,
        overlap_comm: bool,
        comm_dtype: torch.dtype | None,
        grad_dtype: torch.dtype = torch.float32,
        scaling=None,
        ignore_unused_parameters: bool = True,
        norm_group=None,
        plan=None,
        module: torch.nn.Module | None = None,
        param_comm_dtypes: dict | None = None,
        master_dtype: torch.dtype = torch.float32,
    ):
        self.module = module
        self.plan = plan
        self.norm_group = norm_group
        self.device = device
        self.comm_dtype, self.grad_dtype = comm_dtype, grad_dtype
        self.allgather_bucket_size = allgather_bucket_size
        self.reduction = reduction
        self.flat = [
            FlatParamGroup(
                list(g["params"]),
                {k: v for k, v in g.items() if k != "params"},
                bucket_size=reduce_bucket_size,
                world_size=rg.world_size,
                rank=rg.rank,
                param_dtype=param_dtype,
                device=device,
                plan=plan,
                comm_dtypes=param_comm_dtypes,
                master_dtype=master_dtype,
            )
            for g, rg in zip(groups, reduction)
        ]
        self._entries = [(fg, i) for fg in self.flat for i in range(len(fg.layouts))]  # one per unit
        self.units = [self._unit(fg, i, rg) for fg, rg in zip(self.flat, reduction) for i in range(len(fg.layouts))]
        self.masters = [fg.masters[i] for fg, i in self._entries]
        self._finish_setup(
            self._policy(overlap_comm),
            sub_group_size=sub_group_size,
            scaling=scaling,
            comm_dtype=comm_dtype,
            ignore_unused=ignore_unused_parameters,
            param_comm_dtypes=param_comm_dtypes,
        )

    def _policy(self, overlap: bool) -> ReductionPolicy:
        return reduce_scatter_at_boundary(overlap)

    def _unit(self, fg: FlatParamGroup, i: int, rg: ReductionGroup) -> GradUnit:
        """Stage 1: a persistent full gradient buffer; the reduced chunk is kept in place (or copied to
        the host when the optimizer is offloaded)."""
        layout = fg.layouts[i]
        full = torch.zeros(layout.padded, dtype=self.grad_dtype, device=self.device)
        result = self._host_chunk(layout) if self._host_grads() else fg.chunk(layout, full)
        return GradUnit(fg.params, layout, rg, result=result, accum=full)

    def _host_grads(self) -> bool:
        # fp32 gradient shards live with the masters: in host memory when the optimizer is offloaded
        return self.plan is not None and self.plan.master_device != self.device

    def _host_chunk(self, layout) -> torch.Tensor:
        return self.plan.host_zeros(layout.chunk, self.grad_dtype)

    # -- optimizer wiring --------------------------------------------------------------------------
    def optimizer_param_groups(self) -> list[dict]:
        return [{**fg.hparams, "params": list(fg.masters)} for fg in self.flat]

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        """Point a client optimizer's groups (built on model parameters) at this rank's masters."""
        if len(optimizer.param_groups) != len(self.flat):
            raise ValueError("client optimizer param groups do not match the groups zerospeed partitioned")
        for group, fg in zip(optimizer.param_groups, self.flat):
            group["params"] = list(fg.masters)

    @torch.no_grad()
    def refresh_weights(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """After the masters' pieces were set to `value`: every rank's whole copy of the weight too."""
        param.detach().copy_(value.reshape(param.shape))

    def _publish(self, indices: list[int]) -> None:
        """Updated masters of these units into this rank's parameter chunks, while resident."""
        for k in indices:
            fg, i = self._entries[k]
            fg.write_master_to_param(i)

    def _after_step(self) -> None:
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        """Every layout's updated chunks into every rank's parameter buffer, bounded in flight."""
        in_flight: list[tuple[comm.Handle, int]] = []
        flying = 0
        for fg, rg in zip(self.flat, self.reduction):
            for layout, buffer in zip(fg.layouts, fg.param_buffers):
                while in_flight and flying + layout.padded > self.allgather_bucket_size:
                    handle, n = in_flight.pop(0)
                    handle.wait()
                    flying -= n
                in_flight.append(
                    (
                        comm.all_gather_into_tensor(buffer, fg.chunk(layout, buffer), group=rg.group, async_op=True),
                        layout.padded,
                    )
                )
                flying += layout.padded
        for handle, _ in in_flight:
            handle.wait()

    def placement(self) -> dict[str, str]:
        """Where each kind of model state lives, read off the tensors (and the swap files)."""
        return state_placement(
            self.plan,
            params=[b for fg in self.flat for b in fg.param_buffers],
            grads=[u.result for u in self.units],
            stepper=self.stepper,
        )

    # -- checkpoint support ------------------------------------------------------------------------
    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        """This rank's masters (one per layout chunk) and the parameter pieces each holds."""
        out = []
        for fg in self.flat:
            for layout, master in zip(fg.layouts, fg.masters):
                pieces = [
                    Piece(names[id(fg.params[s.param])], s.param_offset, s.offset, s.numel)
                    for s in layout.rank_segments(fg.rank)
                ]
                out.append(ShardEntry(master, pieces))
        return out

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        """After masters were overwritten (a checkpoint load): refresh every rank's full parameters."""
        self._publish(list(range(len(self._entries))))
        self._all_gather_params()

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        """Masters from the model's (possibly 16-bit) parameters — a module-only load."""
        for fg in self.flat:
            for layout, buffer, master in zip(fg.layouts, fg.param_buffers, fg.masters):
                chunk = fg.chunk(layout, buffer)
                if chunk.data_ptr() != master.data_ptr():
                    master.copy_(chunk)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The module's own state dict: every rank holds the whole model between steps."""
        return full_module_state(self.module, dtype)

    # -- introspection -----------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Note [offloaded states] (runtime/zero/offload_states.py): this rank's tensors of each kind."""
        return {
            "hp_params": [m for fg in self.flat for m in fg.masters],
            "lp_params": [b for fg in self.flat for b in fg.param_buffers],
            "lp_grads": [t for u in self.units for t in (u.accum, u.result) if t is not None],
            "contiguous_grad_buffer": [u.staging for u in self.units if u.staging is not None],
        }

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        params = sum(b.nbytes for fg in self.flat for b in fg.param_buffers)
        grads = sum((u.accum if u.accum is not None else u.result).nbytes for u in self.units)
        buffer_ptrs = {b.data_ptr() for fg in self.flat for b in fg.param_buffers}
        masters = sum(
            m.nbytes for fg in self.flat for m in fg.masters if m.untyped_storage().data_ptr() not in buffer_ptrs
        )
        return {
            "parameters": params,
            "gradients": grads,
            "master_weights": masters,
            "optimizer_states": optimizer_state_bytes(optimizer),
        }


class Stage2Strategy(ShardedStrategy):
    """ZeRO stage 2 = stage 1 with the reduce-scatter on every micro-step: only this rank's fp32
    gradient chunk persists."""

    stage = 2
    supports_no_sync = False

    def _policy(self, overlap: bool) -> ReductionPolicy:
        return reduce_scatter_every_micro_step(overlap)

    def _unit(self, fg: FlatParamGroup, i: int, rg: ReductionGroup) -> GradUnit:
        layout = fg.layouts[i]
        result = (
            self._host_chunk(layout)
            if self._host_grads()
            else torch.zeros(layout.chunk, dtype=self.grad_dtype, device=self.device)
        )
        return GradUnit(
            fg.params, layout, rg, result=result, staging_dtype=self.comm_dtype or self.grad_dtype, device=self.device
        )

    def hold_local_gradients(self, on: bool) -> None:
        """Note [local gradients]: full local buffers while `on` (freed when off)."""
        super().hold_local_gradients(on)
        for u in self.units:
            if on and u.accum is None:
                u.accum = torch.zeros(u.layout.padded, dtype=self.grad_dtype, device=self.device)
                u.result.zero_()
            elif not on:
                u.accum = None
