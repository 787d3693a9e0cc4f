"""A stage-3 flat parameter: one unit's parameters of one optimizer group, sharded across ranks.

Note [reused full buffers]: a gather into freshly allocated memory pays the page faults of that
memory on top of the copy (on a CPU host, about 2x the copy itself for a 30 MiB model). ZeRO-Inference
turns recycling on (`Residency.spare`): a host buffer released while gradients are off goes to a free
list and the next gather of the same size writes into it. Training never recycles (autograd may still
hold the released buffer for backward), nor do accelerator buffers (the caching allocator already
reuses them, and knows which stream last used them). A full parameter taken out of a forward is
therefore valid only until its unit is released. The spares are at most the full buffers that were
live at once (bounded by `stage3_max_live_parameters` and the prefetch budget) and stay allocated
between forwards.

Note [freed in place]: autograd keeps what an operation saved for backward — for `nn.Linear` the
weight's transposed *view* of the full buffer — so dropping our reference to a released buffer
frees nothing until that backward has run: every unit used in a forward would stay gathered until
its backward, the whole model at once. A training release therefore frees the buffer's storage in
place (`untyped_storage().resize_(0)`, as FSDP2 does) and keeps the empty tensor; the next gather of
this flat parameter grows that same storage back and writes into it, so a view saved in forward
reads the re-gathered weights (identical: weights change only at a step). The price, as in FSDP2: a
view of a released unit must not be used before the unit is gathered again — its storage has no
memory (on the CPU, reading it crashes the process). The backward pre-hooks gather every unit before
its module's backward, so autograd's saved views are safe; a view kept outside autograd is not.

Lifecycle (explicit, see `State`): SHARDED — the model's parameters point at empty tensors and this
rank holds only its chunk; GATHERING — an all-gather of every rank's chunk into a full buffer is in
flight; FULL — the parameters are views into that buffer. The nn.Parameter objects carry only their
tag, which leads back to the owner (Note [parameter tags], zero/tags.py).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.comm.zeropp import WEIGHT_BITS, WEIGHT_BLOCK
from zerospeed.precision.quantize import quantize_blocks, to_bytes
from zerospeed.zero import tags
from zerospeed.zero.flat_group import flatten_fp32
from zerospeed.zero.partition import build_layouts
from zerospeed.zero.stage3.gather import GatherBatch, Route


class State(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's name for a stage-3 parameter's state (`param.ds_status`), one per `State`."""

    NOT_AVAILABLE = 1  # sharded: only this rank's slice exists
    INFLIGHT = 2  # being gathered
    AVAILABLE = 3  # full


_STATUS = {State.SHARDED: ZeroParamStatus.NOT_AVAILABLE, State.GATHERING: ZeroParamStatus.INFLIGHT}


class ZeroParameter(torch.nn.Parameter):
    """Note [ds_* views]: DeepSpeed's stage 3 sets `ds_numel`, `ds_shape`, `ds_id`, `ds_status`, `ds_tensor`
    (and `ds_persist`) on every partitioned parameter, and user code reads them (`p.ds_numel if hasattr(p,
    "ds_numel") else p.numel()` counts a sharded model's parameters). Here they are read-only properties of
    this subclass, derived on each read from the parameter's owner (its tag, zero/tags.py): no state is
    stored on the parameter, the FlatParam stays the one place its lifecycle lives. A parameter sharded by
    a FlatParam takes this class (`__class__` assignment, as torch's UninitializedParameter.materialize
    does); while it has no owner (made whole again, a deep copy) every `ds_*` read raises AttributeError,
    so `hasattr` answers as for an ordinary parameter.

    `ds_tensor` is this rank's part of the parameter as zerospeed partitions it: the parameter's segment of
    its unit's flat shard (a view). DeepSpeed cuts every parameter alone into ceil(numel / world) pieces;
    zerospeed cuts a unit's flat concatenation, so one parameter's part may be larger, smaller or empty on a
    rank, and the parts of all parameters sum to the rank's shard. Change values through
    `zero.GatheredParameters(..., modifier_rank=...)`, not through this view (16-bit training keeps fp32
    masters that a write here does not reach)."""

    @property
    def ds_numel(self) -> int:
        _owner(self, "ds_numel")
        return tags.full_numel(self)

    @property
    def ds_shape(self) -> torch.Size:
        _owner(self, "ds_shape")
        return tags.full_shape(self)

    @property
    def ds_id(self) -> int:
        return _owner(self, "ds_id").first_id + tags.tag_of(self).index

    @property
    def ds_status(self) -> ZeroParamStatus:
        return _STATUS.get(_owner(self, "ds_status").state, ZeroParamStatus.AVAILABLE)

    @property
    def ds_persist(self) -> bool:
        return _owner(self, "ds_persist").persistent

    @property
    def ds_tensor(self) -> torch.Tensor:
        owner = _owner(self, "ds_tensor")
        return owner.local_part(tags.tag_of(self).index)


def _owner(param: torch.Tensor, name: str) -> FlatParam:
    owner = tags.owner_of(param)
    if owner is None:
        raise AttributeError(f"{name}: this parameter is not partitioned by ZeRO stage 3 (Note [ds_* views])")
    return owner


_ids = itertools.count()  # ds_id: unique per parameter a FlatParam shards, in creation order


_EMPTY: dict[tuple, torch.Tensor] = {}


def empty_like_dtype(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared zero-element tensor that sharded parameters point at."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


@dataclass
class Residency:
    """Elements of full buffers that exist (gathering or full) and that are in flight, kept current
    by the lifecycle transitions so that prefetch decisions need no scan over every unit."""

    live: int = 0
    gathering: int = 0
    # Note [reused full buffers]: None (training) or spare full buffers by (numel, dtype, device)
    spare: dict | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer of `numel` elements: a spare one if recycling is on and one fits."""
        pool = self.spare.get((numel, dtype, device)) if self.spare is not None else None
        return pool.pop() if pool else torch.empty(numel, dtype=dtype, device=device)

    def give(self, full: torch.Tensor) -> None:
        """A released full buffer: kept for the next gather of that size when recycling is on and
        autograd cannot hold it (no gradient mode)."""
        if self.spare is not None and not torch.is_grad_enabled() and full.device.type == "cpu":
            self.spare.setdefault((full.numel(), full.dtype, full.device), []).append(full)


class FlatParam:
    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        values: list[torch.Tensor],
        *,
        group_index: int,
        world_size: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        dp_group=None,
        trainable: bool = True,
        residency: Residency | None = None,
        shard_device: torch.device | None = None,
        master_device: torch.device | None = None,
        pin=None,
        alias_master: bool = True,
        full: torch.Tensor | None = None,
        master_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.index = index
        self.params = params
        self.first_id = next(_ids)  # Note [ds_* views]: parameter i's ds_id is first_id + i
        for _ in params[1:]:
            next(_ids)
        for p in params:
            if type(p) is torch.nn.Parameter:
                p.__class__ = ZeroParameter
        self.shapes = [v.shape for v in values]
        self.group_index = group_index
        self.dtype = dtype
        self.dp_group = dp_group
        self.rank = rank
        self.device = device  # where full parameters are gathered and used
        self.swap = None  # an NvmeParamSwapper once the shard lives in a swap file (offload_param: nvme)
        shard_device = shard_device or device
        master_device = master_device or device
        (self.layout,) = build_layouts([v.numel() for v in values], bucket_size=1 << 62, world_size=world_size)
        # `full`: the values already flattened in this layout, fp32 (Note [re-partitioning zero.Init in
        # place], strategy.py); it is read, never kept
        full = flatten_fp32(self.layout, values, device) if full is None else full
        lo, hi = self.layout.chunk_range(rank)
        self.shard = _placed(full[lo:hi], shard_device, dtype, pin)
        # fp32 training (or bf16 masters, Note [bf16 masters] in precision/policy.py): the master is the
        # shard itself when both live in the same memory; otherwise (16-bit, or offloaded elsewhere) a
        # separate chunk in the master dtype. zero.Init's flat parameters
        # (trainable=False) hold only the shard until the engine re-partitions them.
        self.master = self.grad_shard = None
        if trainable:
            alias = alias_master and dtype == master_dtype and shard_device == master_device
            self.master = torch.nn.Parameter(
                self.shard if alias else _placed(full[lo:hi], master_device, master_dtype, pin)
            )
            self.grad_shard = _placed(torch.zeros(self.layout.chunk), master_device, grad_dtype, pin)
        self.full: torch.Tensor | None = None
        self._freed: torch.Tensor | None = None  # Note [freed in place]: the released full buffer, storage size 0
        self.batch = None  # the GatherBatch in flight while GATHERING
        self.state = State.SHARDED
        self.residency = residency if residency is not None else Residency()
        self.persistent = False
        # ZeRO++ (set by the strategy): qwZ for training fetches; hpZ's sub-group and secondary shard
        # (Note [ZeRO++ gather routes])
        self.quantize_gathers = False
        self.stored: tuple[int, int, bool] | None = None  # (bits, block, symmetric) of a block-quantized shard
        self.stored_nbytes = 0  # its bytes (codes, scales, minimums)
        self.hpz = None  # comm AxisGroup of the hpZ sub-group
        self.secondary: torch.Tensor | None = None
        # Note [deferred tail] (optim/sub_group_step.py): set while the host step that updates this shard may
        # still run; called before anything reads the shard, it waits for that step and publishes it
        self.fence = None
        self._point_params_at_nothing()

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded(self) -> int:
        return self.layout.padded

    # -- lifecycle -------------------------------------------------------------------------------
    def start_gather(self) -> None:
        if self.state is State.SHARDED:
            start_gathers([self])

    def route(self, training: bool) -> Route:
        """How a gather of this flat parameter travels (Note [ZeRO++ gather routes])."""
        if self.stored is not None and not (training and self.secondary is not None):
            return Route.STORED
        if not training:
            return Route.EXACT
        if self.secondary is not None:
            return Route.SECONDARY
        return Route.QUANTIZED if self.quantize_gathers else Route.EXACT

    def wait(self) -> None:
        if self.state is State.SHARDED:
            self.start_gather()
        if self.state is State.GATHERING:
            primary = self.batch.route is not Route.SECONDARY
            self.batch.wait()
            self.batch = None
            if primary and self.hpz is not None and self.secondary is None and not self.persistent:
                size = self.padded // self.hpz.size
                self.secondary = self.full[self.hpz.rank * size : (self.hpz.rank + 1) * size].clone()
            for p, s, shape in zip(self.params, self.layout.segments, self.shapes):
                p.data = self.full[s.offset : s.offset + s.numel].view(shape)
            self.state = State.FULL
            self.residency.gathering -= self.padded

    def release(self) -> None:
        if self.state is State.GATHERING:
            self.batch.wait()  # the collective must complete on every rank before we drop it
            self.batch = None
            self.residency.gathering -= self.padded
        if self.state is not State.SHARDED:
            self.residency.live -= self.padded
        self._point_params_at_nothing()
        if self.full is not None:
            if self.residency.spare is None:  # training: Note [freed in place]
                self.full.untyped_storage().resize_(0)
                self._freed = self.full
            else:
                self.residency.give(self.full)
        self.full = None
        self.state = State.SHARDED

    def full_buffer(self) -> torch.Tensor:
        """The buffer a gather writes this flat parameter's full value into: the storage freed at the last
        release grown back (Note [freed in place]), a recycled spare, or new memory."""
        freed, self._freed = self._freed, None
        if freed is not None:
            freed.untyped_storage().resize_(self.padded * freed.element_size())
            return freed
        return self.residency.take(self.padded, self.dtype, self.device)

    def point_params_at_shapes(self) -> None:
        """While SHARDED: the parameters take their full shapes with no memory (one broadcast zero),
        for a backward that reads no weights but whose gradients autograd checks against the
        parameters' shapes (Note [tied uses], stage3/strategy.py)."""
        if self.state is State.SHARDED:
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            for p, shape in zip(self.params, self.shapes):
                p.data = zero.expand(shape)

    def _point_params_at_nothing(self) -> None:
        empty = empty_like_dtype(self.dtype, self.device)
        for p in self.params:
            p.data = empty

    @torch.no_grad()
    def shard_from_full(self) -> None:
        """After the full buffer was modified (GatheredParameters with a modifier): keep my chunk."""
        lo, hi = self.layout.chunk_range(self.rank)
        self._set_shard(self.full[lo:hi])
        if self.master is not None and (self.shard is None or self.master.data_ptr() != self.shard.data_ptr()):
            self.master.copy_(self.full[lo:hi])

    @torch.no_grad()
    def shard_from_master(self) -> None:
        self.secondary = None  # the weights change: hpZ's secondary shard is stale
        if self.shard is None or self.master.data_ptr() != self.shard.data_ptr():
            self._set_shard(self.master)

    @torch.no_grad()
    def store_quantized(self, bits: int = WEIGHT_BITS, block: int = WEIGHT_BLOCK, symmetric: bool = True) -> None:
        """Keep the shard block-quantized from now on (`ops.quantizer`'s wire format: `bits` per element,
        one scale per `block` elements, and a minimum when asymmetric), for a frozen flat parameter
        (Note [int8-stored frozen shards] in zeropp.py; ZeRO-Inference's quantized weights); its
        gathers then exchange the shards as stored (Route.STORED)."""
        if self.master is not None:
            raise ValueError("only a frozen flat parameter (no master) can be stored quantized")
        if self.stored is not None:
            raise ValueError(f"flat parameter {self.index} is stored quantized already")
        packed = to_bytes(
            quantize_blocks(self.shard if self.swap is None else self.swap.read_shard(self), bits, block, symmetric)
        )
        self.stored_nbytes = packed.numel()
        if self.swap is not None:  # (offload_param nvme: a slot of its own, Note in offload/param_swap.py)
            self.swap.write_packed(self, packed)
        else:  # pinned like the shard it replaces (Note [asynchronous host-to-device gathers], gather.py)
            self.shard = get_accelerator().pin_memory(packed) if self.shard.is_pinned() else packed
        self.stored = (bits, block, symmetric)

    @torch.no_grad()
    def write_shard(self, values: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Set this rank's shard (or its elements at `positions`) to `values`, in memory; a resident full
        copy is then stale (the caller releases it). ZenFlow's selected columns (zero/zenflow.py)."""
        if self.swap is not None or self.stored is not None:
            raise RuntimeError("this flat parameter's shard is not held in memory as values")
        if positions is None:
            return self._set_shard(values)
        self.secondary = None
        self._write_pinned_guard(values)
        self.shard[positions] = values.to(self.shard)

    def _set_shard(self, values: torch.Tensor) -> None:
        self.secondary = None
        if self.stored is not None:
            packed = to_bytes(quantize_blocks(values, *self.stored))
            if self.swap is not None:
                self.swap.write_packed(self, packed)
            else:
                self._write_pinned_guard(packed)
                self.shard.copy_(packed)
        elif self.swap is not None:
            self.swap.write_shard(self, values)
        else:
            self._write_pinned_guard(values)
            self.shard.copy_(values)

    def _write_pinned_guard(self, values: torch.Tensor) -> None:
        """Note [asynchronous host-to-device gathers] (gather.py): a gather may still be reading this
        pinned shard on the device; a host-side write (a checkpoint's frozen values) waits for it. A
        write from the device is ordered after it by the stream already."""
        if values.device.type == "cpu" and self.device.type != "cpu" and self.shard.is_pinned():
            get_accelerator().synchronize()

    def local_part(self, i: int) -> torch.Tensor:
        """Parameter i's elements in this rank's shard (flat; empty when they all lie on other ranks)."""
        if self.stored is not None:
            raise RuntimeError("this flat parameter's shard is stored block-quantized: it holds no values to view")
        if self.fence is not None:
            self.fence()
        shard = self.shard if self.swap is None else self.swap.read_shard(self)
        lo, hi = self.layout.chunk_range(self.rank)
        seg = self.layout.segments[i]
        start, end = max(lo, seg.offset), min(hi, seg.offset + seg.numel)
        return shard[start - lo : max(start, end) - lo]

    @property
    def shard_numel(self) -> int:
        return self.layout.chunk


def _placed(values: torch.Tensor, device: torch.device, dtype: torch.dtype, pin) -> torch.Tensor:
    """A new tensor holding `values` on `device` (pinned host memory through `pin`, an OffloadPlan)."""
    out = values.detach().to(device=device, dtype=dtype, copy=True)
    return pin.pinned(out) if pin is not None and out.device.type == "cpu" else out


def start_gathers(fps: list[FlatParam], training: bool = False) -> None:
    """Issue one all-gather per process group for all of `fps` (SHARDED ones; every rank must pass
    the same list — flat parameters of different groups, e.g. dense and expert, travel apart).
    `training`: a forward/backward fetch, which may take a ZeRO++ route (Note [ZeRO++ gather routes])."""
    todo = [fp for fp in fps if fp.state is State.SHARDED]
    if not todo:
        return
    for fp in todo:  # Note [deferred tail]: the host step that updates the shard first (before its route too)
        if fp.fence is not None:
            fp.fence()
    swap = todo[0].swap
    if swap is not None:
        swap.launch_through()  # the batches read ahead since the last gathers go first (Note [NVMe reads ...])
    for run in _by_route(todo, training):
        route = run[0].route(training)
        if route is Route.STORED:  # each stored shard is exchanged as one buffer of its own
            parts = [[fp] for fp in run]
        else:
            parts = swap.split(run) if swap is not None and route is not Route.SECONDARY else _direct_split(run)
        for part in parts:
            _start_batch(part, route)


# Note [large units gather alone]: a batch of several flat parameters travels as one collective into a
# rank-major receive buffer, then is copied out into each parameter's own full buffer: its send
# (the concatenated shards), the receive buffer and the full buffers coexist, 2.5x the batch at 2
# ranks. Worth it for small units, whose collectives cost their latency; a unit of DIRECT_GATHER
# elements or more is gathered alone, from its shard straight into its full buffer, with no copy.
DIRECT_GATHER = 1 << 18


def _direct_split(run: list[FlatParam]) -> list[list[FlatParam]]:
    """`run` in order, with every large unit in a batch of its own and consecutive small ones together."""
    parts: list[list[FlatParam]] = []
    for fp in run:
        if fp.padded >= DIRECT_GATHER:
            parts.append([fp])
        elif parts and parts[-1][-1].padded < DIRECT_GATHER:
            parts[-1].append(fp)
        else:
            parts.append([fp])
    return parts


def _start_batch(part: list[FlatParam], route: Route) -> None:
    batch = GatherBatch(part, route)
    for fp in part:
        fp.batch = batch
        fp.state = State.GATHERING
        fp.residency.live += fp.padded
        fp.residency.gathering += fp.padded


def _by_route(fps: list[FlatParam], training: bool) -> list[list[FlatParam]]:
    """Consecutive runs of flat parameters sharing a process group and a route, in order (every
    rank decides alike: routes depend only on state all ranks share)."""
    runs: list[list[FlatParam]] = []
    for fp in fps:
        if runs and runs[-1][0].dp_group is fp.dp_group and runs[-1][0].route(training) is fp.route(training):
            runs[-1].append(fp)
        else:
            runs.append([fp])
    return runs
