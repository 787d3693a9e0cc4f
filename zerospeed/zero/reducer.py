"""The one gradient reducer of ZeRO stages 0-3 (and of the pipeline, which drives a stage 0-1 strategy).

Every trainable parameter owns a slot in a `GradUnit`: one flat layout's worth of gradients that
reduce together over one process group. A post-accumulate-grad hook adds each fresh gradient into
its slot and frees the parameter's own `.grad`. When every parameter of a unit has reported, the
unit is ready; ready units launch strictly in order. What differs between the stages is only the
`ReductionPolicy`:

| stage | collective     | when                        | accumulation                                  |
|-------|----------------|-----------------------------|-----------------------------------------------|
| 0     | all-reduce     | the accumulation boundary   | full-size persistent buffer (reduced in place) |
| 1     | reduce-scatter | the accumulation boundary   | full-size persistent buffer; own chunk kept   |
| 2, 3  | reduce-scatter | every micro-step            | transient staging until reduced; reduced chunks accumulate |

Stage 3 also fuses consecutive units (one per module) into one collective of up to
`reduce_bucket_size` elements: a *reduction bucket*.

Note [bucket launch order]: units are launched strictly in index order (unit i only after units
0..i-1), whatever order their gradients become ready in. A parameter unused in this step on one
rank delays that rank's launches until `finish()`, but every rank still issues the same sequence of
collectives, so the job cannot deadlock or reduce mismatched buffers. Units of different process
groups interleave in that same fixed order on every rank, so each group sees one consistent order.

Note [.grad as a slot view]: stage 0 shows each parameter's slot of its persistent buffer as
`param.grad` between a backward and the next one (or the step), as DeepSpeed's stage 0 shows the
accumulated, and at the boundary all-reduced, gradient. A backward that runs while the view is
attached (autograd called directly, without `begin`) accumulates into the slot in place; the hook
then finds its own slot and adds nothing, so nothing is counted twice.

Note [bounded in-flight buckets]: with overlap a bucket's collective runs while backward goes on;
with `max_in_flight` set, launching one more than that first completes the oldest. Staging memory
(the bucket's gradients until reduced, plus its output) is then a constant number of
`reduce_bucket_size` buffers whatever the model size, instead of growing to the whole gradient when
the network lags behind backward. Stage 0's buffers are persistent anyway, so it sets no bound. A
bucket whose collective has already finished lands (and frees its staging) at the next launch, still
in launch order, so the bound is what the network's lag can cost, not what every step pays.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerospeed import comm
from zerospeed.zero.partition import FlatLayout


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"  # every rank keeps the whole reduced gradient
    REDUCE_SCATTER = "reduce_scatter"  # rank r keeps chunk r of each layout


@dataclass(frozen=True)
class ReductionPolicy:
    collective: Collective
    every_micro_step: bool  # reduce on every micro-step (transient staging) or only at the boundary
    overlap: bool = True  # run collectives while backward continues (else wait for each at once)
    max_in_flight: int | None = None  # Note [bounded in-flight buckets]
    fuse_up_to: int = 0  # elements: consecutive units of one group travel together up to this many
    # the reduce-scatter to use, with comm.reduce_scatter_tensor's signature (ZeRO++'s quantized
    # all-to-all, stage3/zeropp.py); None = comm.reduce_scatter_tensor
    reduce_scatter: Callable | None = None


# The policies of the stages: stage 2 is stage 1's collective on every micro-step; stage 3 reduces as
# stage 2 and fuses its per-module units into buckets.
MAX_IN_FLIGHT_BUCKETS = 2


def all_reduce_at_boundary() -> ReductionPolicy:
    return ReductionPolicy(Collective.ALL_REDUCE, every_micro_step=False)


def reduce_scatter_at_boundary(overlap: bool) -> ReductionPolicy:
    return ReductionPolicy(
        Collective.REDUCE_SCATTER, every_micro_step=False, overlap=overlap, max_in_flight=MAX_IN_FLIGHT_BUCKETS
    )


def reduce_scatter_every_micro_step(
    overlap: bool, fuse_up_to: int = 0, reduce_scatter: Callable | None = None
) -> ReductionPolicy:
    return ReductionPolicy(
        Collective.REDUCE_SCATTER,
        every_micro_step=True,
        overlap=overlap,
        max_in_flight=MAX_IN_FLIGHT_BUCKETS,
        fuse_up_to=fuse_up_to,
        reduce_scatter=reduce_scatter,
    )


class GradUnit:
    """One flat layout's gradients: where they accumulate, the group they reduce over, where the
    reduced result lands.

    `accum` is a persistent full-size buffer (stages 0-1) or None (stages 2-3: a transient staging
    buffer of `staging_dtype` exists only between the first gradient and the collective). `result`
    receives the reduction: the whole `accum` (all-reduce), this rank's chunk of it (reduce-scatter
    in place), a host copy of that chunk (offloaded), or a persistent gradient chunk that reduced
    micro-steps are added into (stages 2-3).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        reduction,
        *,
        result: torch.Tensor,
        accum: torch.Tensor | None = None,
        staging_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        only: set[int] | None = None,
    ):
        self.params, self.layout = params, layout
        # the segments whose gradients arrive here: those of `params` indices in `only` (None: all; a
        # stage-3 tied use reports only the parameters it shares, Note [tied uses], zero/stage3/strategy.py)
        self.reporting = [s for s in layout.segments if only is None or s.param in only]
        # the ranks it reduces over (a zero.strategy.ReductionGroup)
        self.group, self.world_size, self.rank = reduction.group, reduction.world_size, reduction.rank
        # Note [MiCS] (zero/strategy.py): after the reduce-scatter, the chunk is all-reduced over the replicas
        self.replica_group, self.replicas = reduction.replica_group, reduction.replicas
        self.accum, self.result = accum, result
        self.staging_dtype = staging_dtype
        self.device = device if device is not None else result.device
        self.staging: torch.Tensor | None = None
        self.pending = 0
        self.seen: set[int] = set()

    @property
    def members(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this unit holds (`params` may be a whole group's list)."""
        return [self.params[s.param] for s in self.reporting]

    def add(self, seg, grad: torch.Tensor) -> None:
        flat = grad.reshape(-1)
        if self.accum is None and self.staging is None:
            self.staging = self._first_staging(seg, flat)
        else:
            self.source()[seg.offset : seg.offset + seg.numel].add_(flat)

    def _first_staging(self, seg, flat: torch.Tensor) -> torch.Tensor:
        """The staging buffer, made by the first gradient to arrive: its slot holds a copy (no zero-fill
        and add), or — when that gradient is the whole unpadded layout in the staging dtype and
        owns its memory, as autograd's fresh gradient does once `.grad` is dropped — the gradient
        itself (no copy at all). The rest is zeroed for the gradients still to come."""
        n = self.layout.padded
        if (
            seg.offset == 0
            and seg.numel == n
            and flat.dtype == self.staging_dtype
            and flat.device == self.device
            and flat.is_contiguous()
            and flat.storage_offset() == 0
            and flat.untyped_storage().nbytes() == flat.nbytes
        ):
            return flat
        staging = torch.empty(n, dtype=self.staging_dtype, device=self.device)
        staging[: seg.offset].zero_()
        staging[seg.offset + seg.numel :].zero_()
        staging[seg.offset : seg.offset + seg.numel].copy_(flat)
        return staging

    def is_slot(self, seg, grad: torch.Tensor) -> bool:
        """`grad` is this segment's slot of the persistent buffer itself (Note [.grad as a slot view])."""
        return (
            self.accum is not None
            and grad.dtype == self.accum.dtype
            and grad.device == self.accum.device
            and grad.data_ptr() == self.accum.data_ptr() + seg.offset * self.accum.element_size()
        )

    def source(self) -> torch.Tensor:
        """The buffer gradients add into and the collective reduces (a unit no gradient reached still
        takes part, with zeros)."""
        if self.accum is not None:
            return self.accum
        if self.staging is None:
            self.staging = torch.zeros(self.layout.padded, dtype=self.staging_dtype, device=self.device)
        return self.staging

    def deliver(self, part: torch.Tensor) -> None:
        """Land this unit's reduced part (a view of the collective's output) in `result` — unless it
        was reduced in place. Accumulated-before gradients are copied; reduced-per-micro-step ones add up."""
        if part.data_ptr() != self.result.data_ptr():
            if self.accum is not None:
                self.result.copy_(part)
            else:
                self.result.add_(part if part.device == self.result.device else part.to(self.result.device))
        self.staging = None

    def zero(self) -> None:
        (self.accum if self.accum is not None else self.result).zero_()
        self.staging = None  # (held unreduced by a coalesced block, Note [coalesced reduction]; else None)


@dataclass
class _Flight:
    units: list[GradUnit]
    out: torch.Tensor
    handle: comm.Handle


Scaling = Callable[[int], tuple[float, float]]  # group size -> (factor before, factor after) the sum


def _no_scaling(world_size: int) -> tuple[float, float]:
    return 1.0, 1.0


def weak_hook(method: Callable) -> Callable:
    """A tensor hook that calls `method` while its object lives and does nothing after.

    Note [weak tensor hooks]: a hook stored on a parameter that holds its owner strongly makes a cycle
    (parameter -> hook -> reducer -> units -> parameter) that Python's collector cannot break: it
    does not see the references of a tensor's hooks (checked on a bare parameter whose hook is a
    method of an object holding it: never collected, with or without a backward; the same cycle
    through a plain attribute is). Every engine built in a process then kept its
    buffers alive after the user dropped it (measured: 21 MiB per dropped engine of a 2.4M-parameter
    GPT at stage 1). Through a weak reference the owner is freed with the engine.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


class GradientReducer:
    """Hooks every parameter of `units`, accumulates, and reduces ready units in order (see module doc)."""

    def __init__(
        self,
        units: list[GradUnit],
        policy: ReductionPolicy,
        *,
        scaling: Scaling | None = None,
        comm_dtype: torch.dtype | None = None,
        ignore_unused: bool = True,
        on_unit_ready: Callable[[GradUnit], None] | None = None,
        param_comm_dtypes: dict[int, torch.dtype] | None = None,
        on_delivered: Callable[[GradUnit], None] | None = None,
    ):
        self.units, self.policy = units, policy
        # called with each unit once its reduced part has landed in `result` (Note [overlapped step] in
        # optim/sub_group_step.py starts host steps from it)
        self.on_delivered = on_delivered
        self.scaling, self.comm_dtype = scaling or _no_scaling, comm_dtype
        # id(parameter) -> the dtype its gradient travels in, where not `comm_dtype` (Note [autocast
        # gradient communication] in runtime/torch_autocast.py)
        self.param_comm_dtypes = param_comm_dtypes or {}
        self.ignore_unused = ignore_unused
        self.on_unit_ready = on_unit_ready
        self._slot = {id(u.params[s.param]): (u, s) for u in units for s in u.reporting}
        self.reducing = False
        # Note [local gradients]: no reduction at all, only local accumulation (a 1-bit optimizer's
        # compressed stage at ZeRO-2, which reduces the momentum itself; a coalesced block, whose stage-3
        # units keep their staging across backwards: Note [coalesced reduction], runtime/grad_accumulation.py)
        self.hold_local = False
        self.reduced = False  # the buffers hold a completed reduction (since the last zero())
        self.holds_grads = False  # a gradient arrived since the last zero()
        self._next = 0
        self._bucket: list[GradUnit] = []
        self._bucket_elems = 0
        self._in_flight: list[_Flight] = []
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for u in units for p in u.members]

    # -- backward -------------------------------------------------------------------------------
    def begin(self, sync: bool) -> None:
        """Before each backward; `sync` is true on the micro-step that ends the accumulation window."""
        self.reducing = not self.hold_local and (sync or self.policy.every_micro_step)
        self._next = 0
        for u in self.units:
            u.pending = len(u.reporting)
            u.seen = set()

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        unit, seg = self._slot[id(param)]
        grad = param.grad
        if grad.layout != torch.strided:
            # Note [sparse gradients]: an nn.Embedding(sparse=True) gives a sparse COO gradient; it is added
            # into the flat (dense) buffer like any other and reduced dense (DeepSpeed reduces it sparse, an
            # all-gather of indices and values: fewer bytes when few rows are touched, the same sums)
            unit.add(seg, grad.to_dense())
        elif not unit.is_slot(seg, grad):  # else autograd already added into the slot in place
            unit.add(seg, grad)
        param.grad = None
        self.holds_grads = True
        unit.seen.add(seg.param)
        if not self.reducing and self.on_unit_ready is None:
            return
        unit.pending -= 1
        if unit.pending == 0 and self.on_unit_ready is not None:
            self.on_unit_ready(unit)  # (also while holding: stage 3 releases the unit's gathered weights)
        if not self.reducing:
            return
        while self._next < len(self.units) and self.units[self._next].pending <= 0:
            self._launch(self.units[self._next])
            self._next += 1

    def _launch(self, unit: GradUnit) -> None:
        """Add `unit` to the current reduction bucket; send the bucket once it is full enough."""
        self._land_finished()
        if self._bucket and (
            self._bucket[0].group is not unit.group
            or self.unit_comm_dtype(self._bucket[0]) != self.unit_comm_dtype(unit)
        ):
            self._flush()
        self._bucket.append(unit)
        self._bucket_elems += unit.layout.padded
        if self._bucket_elems >= self.policy.fuse_up_to:
            self._flush()

    def _flush(self) -> None:
        units, self._bucket, self._bucket_elems = self._bucket, [], 0
        if not units:
            return
        world = units[0].world_size
        if world == 1 and units[0].replicas == 1:  # nothing to exchange: no scaling, no cast to comm_dtype
            for u in units:
                u.deliver(u.source()[: u.layout.chunk])
                self._delivered(u)
            return
        pre, _ = self.scaling(world * units[0].replicas)  # the average is over every contributing rank
        sends = [self._scaled_source(u, pre) for u in units]
        scatter = self.policy.collective is Collective.REDUCE_SCATTER
        if len(sends) == 1:
            send = sends[0]
        elif scatter:  # rank-major: rank r's chunk of every unit, then rank r + 1's
            send = torch.cat([s.view(world, -1) for s in sends], dim=1).reshape(-1)
        else:
            send = torch.cat(sends)
        del sends  # (its references alone would keep every unit's staging alive through the collective)
        for u in units:  # staging copied into the send buffer is not needed until the result lands
            if u.accum is None and u.staging is not send:
                u.staging = None
        if not scatter:
            out = send
            handle = comm.all_reduce(send, op="sum", group=units[0].group, async_op=True)
        else:
            if len(units) == 1 and send is units[0].accum:  # stage 1: this rank's chunk of its own buffer
                lo, hi = units[0].layout.chunk_range(units[0].rank)
                out = send[lo:hi]
            else:
                out = torch.empty(sum(u.layout.chunk for u in units), dtype=send.dtype, device=send.device)
            scatter = self.policy.reduce_scatter or comm.reduce_scatter_tensor
            handle = scatter(out, send, op="sum", group=units[0].group, async_op=True)
        self._in_flight.append(_Flight(units, out, handle))
        if not self.policy.overlap:
            self._complete_all()
        elif self.policy.max_in_flight is not None and len(self._in_flight) > self.policy.max_in_flight:
            self._complete(self._in_flight.pop(0))

    def unit_comm_dtype(self, unit: GradUnit) -> torch.dtype | None:
        """The dtype `unit` is reduced in: its parameters' own where they all share one, else `comm_dtype`
        (None: the buffer's dtype)."""
        if not self.param_comm_dtypes:
            return self.comm_dtype
        kinds = {self.param_comm_dtypes.get(id(p), self.comm_dtype) for p in unit.members}
        return kinds.pop() if len(kinds) == 1 else self.comm_dtype

    def _scaled_source(self, unit: GradUnit, pre: float) -> torch.Tensor:
        src = unit.source()
        if pre != 1.0:
            src.mul_(pre)
        dtype = self.unit_comm_dtype(unit)
        if dtype is not None and dtype != src.dtype:
            src = src.to(dtype)
        return src

    @torch.no_grad()
    def _complete(self, flight: _Flight) -> None:
        """Wait, then land each unit's part. The factor after the sum applies where the values end:
        an all-reduced gradient in its (fp32) accumulation buffer, a reduce-scattered chunk in the
        collective's output, as each stage did before there was one reducer."""
        flight.handle.wait()
        first = flight.units[0]
        _, post = self.scaling(first.world_size * first.replicas)
        scatter = self.policy.collective is Collective.REDUCE_SCATTER
        if first.replicas > 1:  # Note [MiCS]: this chunk's sum over the other shard groups too
            if not scatter:
                raise RuntimeError("MiCS replica groups reduce after a reduce-scatter only (stage 3)")
            comm.all_reduce(flight.out, op="sum", group=first.replica_group)
        if scatter and post != 1.0:
            flight.out.mul_(post)
        offset = 0
        for u in flight.units:
            n = u.layout.chunk if scatter else u.layout.padded
            u.deliver(flight.out[offset : offset + n])
            if not scatter and post != 1.0:
                u.result.mul_(post)
            self._delivered(u)
            offset += n

    def _delivered(self, unit: GradUnit) -> None:
        if self.on_delivered is not None:
            self.on_delivered(unit)

    def _land_finished(self) -> None:
        """Land the oldest buckets whose collectives have already finished, in launch order, so their
        staging is freed now rather than at the next bound (Note [bounded in-flight buckets])."""
        while self._in_flight and self._in_flight[0].handle.done():
            self._complete(self._in_flight.pop(0))

    def _complete_all(self) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    # -- the end of a reduction -----------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """Launch what unused parameters held back, then wait for every collective."""
        if not self.reducing:
            return
        self._check_unused()
        while self._next < len(self.units):
            self._launch(self.units[self._next])
            self._next += 1
        self._flush()
        self._complete_all()
        self.reducing = False
        self.reduced = True

    def _check_unused(self) -> None:
        if self.ignore_unused:
            return
        missing = [
            f"parameter of shape {tuple(u.params[s.param].shape)} (unit {i})"
            for i, u in enumerate(self.units)
            for s in u.reporting
            if s.param not in u.seen
        ]
        if missing:
            raise RuntimeError(
                "parameters received no gradient this step: "
                + "; ".join(missing[:5])
                + " — set zero_optimization.ignore_unused_parameters to true to allow this"
            )

    def zero(self) -> None:
        for u in self.units:
            u.zero()
        self.reduced = False
        self.holds_grads = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
