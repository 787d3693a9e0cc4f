"""The one gateway to torch.distributed: process-group set-up and the collectives zerospeed uses.

Only this package imports torch.distributed. Every collective takes an explicit `group` (None means
the default world group) and returns a `Handle` when `async_op=True`, so callers can overlap
communication with computation and wait later.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import enum
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from zerospeed.accelerator import get_accelerator
from zerospeed.comm.stats import CommStats

# Newer torch renamed the tensor collectives; older releases only have the first names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

STATS = CommStats()

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = _dt.timedelta(minutes=30)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class ReduceOp(enum.StrEnum):
    """The reduce ops of the collectives under DeepSpeed's names (`deepspeed.comm.ReduceOp.MAX`); each
    member is its op string, so `op=ReduceOp.MAX` and `op="max"` are the same op."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(
    dist_backend: str | None = None,
    timeout: _dt.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    auto_mpi_discovery: bool = False,
    dist_init_required: bool | None = None,
) -> None:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.

    Works under our launcher and torchrun alike. Without those variables (a plain `python train.py`)
    it forms a one-process group, so the same script runs unchanged on a laptop. Calling it again
    once initialised is a no-op.
    """
    if dist.is_initialized():
        _bind_device()  # initialised by the caller: the object collectives still need this rank's GPU current
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; "
            "initialise it yourself or pass dist_init_required=None/True"
        )
    backend = dist_backend or get_accelerator().communication_backend_name()
    if backend == "nccl" and get_accelerator().name != "cuda":
        raise RuntimeError(
            "init_distributed(dist_backend='nccl') on the cpu accelerator: NCCL moves GPU tensors "
            "only, and zerospeed would place every tensor on the host; use dist_backend='gloo' or "
            "unset ZEROSPEED_ACCELERATOR=cpu on a machine with GPUs"
        )
    env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
    rank = rank if rank >= 0 else (env_rank if env_rank is not None else 0)
    world_size = world_size if world_size > 0 else (env_world if env_world is not None else 1)
    local_rank = _env_int("LOCAL_RANK") or 0
    get_accelerator().set_device(local_rank)
    if world_size == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
        # A one-process group needs no rendezvous: an in-memory store avoids port clashes.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend, init_method=init_method or "env://", rank=rank, world_size=world_size, timeout=timeout
        )
    logger.info("initialised %s process group: rank %d of %d", backend, rank, world_size)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Let gloo's worker threads drop their last references, then destroy the process group — all
    before the interpreter finalizes.

    Note [gloo teardown at exit]: a gloo worker thread destroys each completed collective's work
    object itself, shortly after the waiter was released (a barrier's work even holds the works that
    were in flight when it was issued). Dropping a tensor whose Python object only the work kept
    alive needs the GIL; if the main thread has already begun finalizing, the worker cannot take it,
    is unwound, and the C++ runtime aborts a rank that had finished cleanly ("terminate called
    without an active exception", SIGABRT; seen about one run in fifteen on this machine, always
    after the job's last barrier). Sleeping releases the GIL so the workers can finish first."""
    try:
        if is_initialized():
            time.sleep(EXIT_GRACE_S)
            destroy()
            time.sleep(EXIT_GRACE_S)
    except Exception:  # noqa: BLE001 — at exit, a failed teardown must not mask the exit status
        pass


EXIT_GRACE_S = 0.05


def backend_availability() -> dict[str, str]:
    """Which communication backends this torch build offers (for the environment report)."""
    if not dist.is_available():
        return {"torch.distributed": "not available"}
    return {
        "torch.distributed": "available",
        "gloo": str(dist.is_gloo_available()),
        "nccl": str(dist.is_nccl_available()),
        "mpi": str(dist.is_mpi_available()),
    }


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def destroy_process_group(group=None) -> None:
    """DeepSpeed's `deepspeed.comm.destroy_process_group`: one group, or (None) every group and the world's."""
    if group is None:
        destroy()
    elif group is not SELF:  # this rank's own group is no torch group (Note [size-1 axes])
        dist.destroy_process_group(group)


class _SelfGroup:
    """The group of this rank alone (Note [size-1 axes] in comm/mesh.py): every collective on it is
    the identity, so it needs no torch process group — and making one would be collective."""

    def __repr__(self) -> str:
        return "comm.SELF"


SELF = _SelfGroup()


def get_rank(group=None) -> int:
    if group is SELF:
        return 0
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    if group is SELF:
        return 1
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return _env_int("LOCAL_RANK") or 0


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` within `group` (None = the world group)."""
    if group is SELF:
        return get_rank()
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _bind_device() -> None:
    """Make this rank's accelerator device current (NCCL's object collectives and barrier use it)."""
    if get_accelerator().name != "cpu":
        get_accelerator().set_device(get_local_rank())


def _is_nccl(group) -> bool:
    return dist.get_backend(None if group is SELF else group) == "nccl"


def _check_tensors(kind: str, group, *tensors: torch.Tensor) -> None:
    """Note [what NCCL refuses]: host tensors and non-contiguous tensors, which gloo takes. They are
    refused here by name, with the fix — also in a one-rank NCCL group, where no collective runs, so
    that a single-GPU run finds what two GPUs would hang or fail on. (What no check can see: ranks
    passing different dtypes or sizes to one collective; NCCL then returns garbage or hangs.)"""
    if not is_initialized() or not _is_nccl(group):
        return
    for t in tensors:
        if t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(
                f"NCCL {kind}: every tensor must be contiguous and on this rank's GPU, got a "
                f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} tensor of shape "
                f"{tuple(t.shape)} on {t.device}; create it with device=<the engine's device> "
                "(or .to(device).contiguous() it) before the collective"
            )


def new_group(ranks: list[int]):
    """A process group over `ranks`. Every process must call it, with the same ranks, in order."""
    return dist.new_group(ranks=ranks)


class Handle:
    """An in-flight collective; `wait()` blocks until its result is in the tensor."""

    def __init__(self, work=None, record=None):
        self._work = work
        self._record = record

    def done(self) -> bool:
        """The collective has completed (`wait()` would not block); does not wait."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._record is not None:
                self._record()
                self._record = None


def _eager(collective):
    """A collective run outside any torch.compile graph: dynamo breaks the graph around the call instead
    of tracing its bookkeeping (Note [compiled modules at stage 3] in zero/stage3/strategy.py)."""
    return torch.compiler.disable(collective, recursive=True)


def _issue(kind: str, nbytes: int, group, async_op: bool, launch):
    """Run one collective, counting its bytes and the time until its result is usable."""
    start = time.perf_counter()
    world = get_world_size(group)
    work = launch()

    def record():
        STATS.record(kind, nbytes, time.perf_counter() - start, world)

    if async_op:
        return Handle(work, record)
    record()
    return None


def _op(op: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_OPS) + ['avg']}") from None


@_eager
def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, async_op: bool = False):
    """Reduce `tensor` in place across the group. op: sum | avg | max | min."""
    _check_tensors("all_reduce", group, tensor)
    if get_world_size(group) == 1:
        return Handle() if async_op else None
    if op == "avg":
        # gloo has no AVG; dividing first keeps one code path for every backend.
        tensor.div_(get_world_size(group))
        op = "sum"
    return _issue(
        "all_reduce",
        tensor.nbytes,
        group,
        async_op,
        lambda: dist.all_reduce(tensor, op=_op(op), group=group, async_op=async_op),
    )


@_eager
def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """Copy `tensor` from global rank `src` to every rank of the group, in place."""
    _check_tensors("broadcast", group, tensor)
    if get_world_size(group) == 1:
        return Handle() if async_op else None
    return _issue(
        "broadcast",
        tensor.nbytes,
        group,
        async_op,
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
    )


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


@_eager
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate each rank's `input` (equal sizes) into `output`, rank order."""
    world = get_world_size(group)
    _check_tensors("all_gather_into_tensor", group, output, input)
    if world == 1:
        output.copy_(input.reshape(output.shape))
        return Handle() if async_op else None
    if _is_gloo(group):  # Note [gloo all-gathers as exchanges]
        return _issue(
            "all_gather",
            output.nbytes,
            group,
            async_op,
            lambda: _exchange_gather(output, input, group, world, async_op),
        )
    return _issue(
        "all_gather",
        output.nbytes,
        group,
        async_op,
        lambda: _all_gather_tensor(output, input, group=group, async_op=async_op),
    )


# Note [gloo all-gathers as exchanges]: on gloo a collective's fixed cost, not its bytes, dominates the
# gathers stage 3 issues (~70 per micro-step on a 4 x 256 GPT with its default budgets, half of them the
# 8-byte divergence codes), and with ranks sharing the host's cores that cost is host time taken from the
# compute. gloo's list all-gather also stages the whole result in a flat buffer of its own and copies it out.
# Its point-to-point transfers cost less for the same bytes (2 ranks, 2-core host, medians: ~0.1-0.2 ms an
# isend/irecv pair against ~0.2-0.6 ms an all-gather at 1-256K elements; 1M elements ~2.5 vs ~3.8 ms). On
# gloo an all-gather is therefore an exchange: this rank's input sent to every other rank, each other
# rank's received straight into its slice of `output` (no staging copy); `all_gather_coalesced` sends
# several tensors' bytes in one message per peer; a two-rank reduce-scatter sends the half the peer keeps
# and adds the half it receives (two operands: the sum gloo computes, bit for bit). Each rank sends what a
# ring algorithm would, (N-1)/N of the gathered bytes, so the wire model and the counters are unchanged.
# Every rank posts its collectives in the same order and gloo matches the transfers between two ranks in
# posting order per tag, so exchanges in flight together cannot cross; their own tag keeps them apart from
# other point-to-point traffic on the group (pipeline transfers use tag 0). Measured on the 4 x 256 GPT
# (2 ranks, micro batch 4, accumulation 2, fp32, bench_step's zs3): 491 -> 446 ms per step, 160f9d7 388.
EXCHANGE_TAG = 0x7A53


class _Exchange:
    """The point-to-point works of one exchange, waited on as one (a `Handle`'s work); `then` runs once
    they have completed (a reduce-scatter's sum)."""

    def __init__(self, works: list, then=None) -> None:
        self.works = works
        self.then = then

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()


@_eager
def all_gather_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group=None, async_op: bool = False):
    """`all_gather_into_tensor(outputs[i], inputs[i])` for every i (any dtypes, equal sizes across ranks), as
    one exchange on gloo (Note [gloo all-gathers as exchanges]: the inputs' bytes travel in one message per
    peer; a collective's fixed cost, not its bytes, dominates small gathers there), as one collective each
    elsewhere. Counted as one all-gather per tensor, with its own bytes, as the separate calls would be."""
    world = get_world_size(group)
    if world == 1 or not _is_gloo(group):
        handles = [all_gather_into_tensor(o, i, group=group, async_op=async_op) for o, i in zip(outputs, inputs)]
        return _Handles(handles) if async_op else None
    _check_tensors("all_gather_coalesced", group, *outputs, *inputs)
    start = time.perf_counter()
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    sends = [t.reshape(-1).view(torch.uint8) for t in inputs]
    send = torch.cat(sends)
    rows = torch.empty(world - 1, send.numel(), dtype=torch.uint8, device=send.device)
    works = []
    for k in range(1, world):
        works.append(pg.send([send], (rank + k) % world, EXCHANGE_TAG))
        works.append(pg.recv([rows[k - 1]], (rank - k) % world, EXCHANGE_TAG))
    pieces = [o.view(-1).view(torch.uint8).view(world, -1) for o in outputs]
    for piece, mine in zip(pieces, sends):
        piece[rank].copy_(mine)

    def unpack() -> None:
        for k in range(1, world):
            offset = 0
            for piece in pieces:
                n = piece.shape[1]
                piece[(rank - k) % world].copy_(rows[k - 1, offset : offset + n])
                offset += n
        elapsed = time.perf_counter() - start
        for o in outputs:
            STATS.record("all_gather", o.nbytes, elapsed, world)

    exchange = _Exchange(works, unpack)
    if async_op:
        return Handle(exchange)
    exchange.wait()
    return None


class _Handles:
    """Several handles waited on as one."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def _exchange_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group, async_op: bool):
    """`reduce_scatter_tensor` over two gloo ranks as one exchange: each rank sends the half the other
    keeps and adds the half it receives to its own. Two operands: the same sum in either order, so the
    result is bit-identical to gloo's (Note [gloo all-gathers as exchanges])."""
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    mine, theirs = input.view(-1).chunk(2)[rank], input.view(-1).chunk(2)[1 - rank]
    received = torch.empty_like(mine)
    works = [pg.send([theirs], 1 - rank, EXCHANGE_TAG), pg.recv([received], 1 - rank, EXCHANGE_TAG)]
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]

    def reduce() -> None:  # (elementwise: `output` may be `mine` itself)
        combine(mine, received, out=output.view(-1))

    exchange = _Exchange(works, reduce)
    if async_op:
        return exchange
    exchange.wait()
    return None


def _exchange_gather(output: torch.Tensor, input: torch.Tensor, group, world: int, async_op: bool):
    """Note [gloo all-gathers as exchanges]: `all_gather_into_tensor` on gloo as isend/irecv pairs."""
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    send = input.reshape(-1)
    pieces = output.view(-1).chunk(world)
    works = []
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        works.append(pg.send([send], dst, EXCHANGE_TAG))
        works.append(pg.recv([pieces[src]], src, EXCHANGE_TAG))
    pieces[rank].copy_(send)
    exchange = _Exchange(works)
    if async_op:
        return exchange
    exchange.wait()
    return None


@_eager
def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, async_op: bool = False
):
    """Reduce `input` across ranks and leave rank r's equal slice r in `output`."""
    _check_tensors("reduce_scatter_tensor", group, output, input)
    if get_world_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return Handle() if async_op else None
    if op == "avg":
        input.div_(get_world_size(group))
        op = "sum"
    if _is_gloo(group) and get_world_size(group) == 2:  # Note [gloo all-gathers as exchanges]
        return _issue(
            "reduce_scatter",
            input.nbytes,
            group,
            async_op,
            lambda: _exchange_reduce_scatter(output, input, op, group, async_op),
        )
    if _is_gloo(group):
        # gloo's list reduce-scatter is ~1.5x faster than its tensor form (measured, 4M floats).
        world = get_world_size(group)
        return _issue(
            "reduce_scatter",
            input.nbytes,
            group,
            async_op,
            lambda: dist.reduce_scatter(
                output.view(-1), list(input.view(-1).chunk(world)), op=_op(op), group=group, async_op=async_op
            ),
        )
    return _issue(
        "reduce_scatter",
        input.nbytes,
        group,
        async_op,
        lambda: _reduce_scatter_tensor(output, input, op=_op(op), group=group, async_op=async_op),
    )


@_eager
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
    async_op: bool = False,
):
    """Send slice j of `input` (along dim 0) to rank j and receive rank j's slice for this rank into slice j of
    `output`. Without split sizes the slices are equal (dim 0 divisible by the group size); with them, uneven.

    Counted as payload = `input`'s bytes, wire = the bytes that leave this rank (all but its own slice)."""
    world = get_world_size(group)
    _check_tensors("all_to_all_single", group, output, input)
    if world == 1:
        output.copy_(input.reshape(output.shape))
        return Handle() if async_op else None
    rows = input.shape[0]
    if input_split_sizes is None:
        if rows % world:
            raise ValueError(
                f"all_to_all_single: dim 0 of the input ({rows}) is not divisible by the group size "
                f"{world}; pass input_split_sizes / output_split_sizes for uneven slices"
            )
        own = rows // world
    else:
        own = input_split_sizes[get_rank(group)]
    per_row = input.nbytes // rows if rows else 0
    wire = (rows - own) * per_row
    start = time.perf_counter()
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def record():
        STATS.record("all_to_all", input.nbytes, time.perf_counter() - start, world, wire_bytes=wire)

    if async_op:
        return Handle(work, record)
    record()
    return None


@_eager
def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (NCCL: the pickles travel through tensors on the
    current GPU, which must be this rank's)."""
    if get_world_size(group) == 1:
        return [obj]
    _bind_device()
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@_eager
def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Rank `src`'s picklable `obj` on every rank."""
    if get_world_size(group) == 1:
        return obj
    _bind_device()
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@_eager
def barrier(group=None) -> None:
    if get_world_size(group) <= 1:
        return
    if _is_nccl(group):  # NCCL's barrier is an all-reduce on a GPU: name this rank's
        _bind_device()
        dist.barrier(group=group, device_ids=[get_accelerator().torch_device(get_local_rank()).index])
    else:
        dist.barrier(group=group)
