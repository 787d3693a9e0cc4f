"""Moving activations and gradients between stages: shape negotiation and batched transfers.

A message is a tensor or a tuple of tensors. The first time a message key (kind, boundary virtual
stage, mode) is used, its layout (count, tuple-ness, per tensor: dtype, requires_grad, shape) travels
first as a small fixed-size int64 tensor; both sides cache it, and later messages with that key carry
only data. Sender and receiver agree on "first time" because each key names one channel and messages
on a channel arrive in order. How the layouts and the data of one batch are posted so that NCCL
cannot deadlock: Note [negotiation inside a batch].

A message travels as one transfer of bytes: a lone tensor as its own bytes, a tuple's tensors packed
into one buffer at 16-byte-aligned offsets (copied out again on arrival) — Note [one transfer per
message]. Bytes let every dtype of `_DTYPES` cross NCCL too (NCCL has no int16).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.p2p import warm_up

META_LEN = 96
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MessageMeta:
    is_tuple: bool
    tensors: tuple[TensorMeta, ...]


def as_tensors(value: Any, what: str) -> tuple[bool, list[torch.Tensor]]:
    """(was it a tuple, its tensors); anything else is an error naming `what`."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what}: pipeline messages must be tensors or tuples of tensors; item {i} is {type(t).__name__}"
            )
    return isinstance(value, (tuple, list)), items


def describe(value: Any, what: str) -> MessageMeta:
    is_tuple, items = as_tensors(value, what)
    return MessageMeta(is_tuple, tuple(TensorMeta(t.dtype, t.requires_grad, tuple(t.shape)) for t in items))


def channel_code(key: tuple) -> int:
    """A number naming message key `key`, the same in every process (checked when a layout arrives)."""
    return zlib.crc32(repr(key).encode())


def encode(meta: MessageMeta, key: tuple | None = None) -> torch.Tensor:
    """The layout as META_LEN int64s: [n, is_tuple, then per tensor: dtype, requires_grad, ndim, dims...];
    the last one is `channel_code(key)` (0 without a key)."""
    out = [len(meta.tensors), int(meta.is_tuple)]
    for t in meta.tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline messages cannot carry {t.dtype}; supported: {_DTYPES}")
        if len(t.shape) > _MAX_DIMS:
            raise ValueError(f"pipeline messages carry at most {_MAX_DIMS} dimensions, got shape {t.shape}")
        out += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
    if len(out) > META_LEN - 1:
        raise ValueError(
            f"pipeline message layout needs {len(out)} integers, more than {META_LEN} "
            "less the one naming the channel: send fewer tensors per message"
        )
    code = channel_code(key) if key is not None else 0
    return torch.tensor(out + [0] * (META_LEN - 1 - len(out)) + [code], dtype=torch.int64)


def decode(buf: torch.Tensor) -> MessageMeta:
    vals = buf.tolist()
    n, is_tuple, pos, tensors = vals[0], bool(vals[1]), 2, []
    for _ in range(n):
        dtype, rg, ndim = _DTYPES[vals[pos]], bool(vals[pos + 1]), vals[pos + 2]
        tensors.append(TensorMeta(dtype, rg, tuple(vals[pos + 3 : pos + 3 + ndim])))
        pos += 3 + ndim
    return MessageMeta(is_tuple, tuple(tensors))


@dataclass
class SendOp:
    key: tuple
    value: Any
    peer: int


@dataclass
class RecvOp:
    key: tuple
    peer: int


@dataclass(frozen=True)
class Transfer:
    """One message's part of a batch: the "layout" or the "data" of operation `op` (its index)."""

    kind: str  # "send" | "recv"
    what: str  # "layout" | "data"
    op: int


def plan(ops: list[SendOp | RecvOp], sent: set | dict, received: set | dict) -> list[list[Transfer]]:
    """The groups a batch is posted as, in order, given the keys whose layouts are known (`sent`,
    `received`): [known data, layouts sent, new data sent, layouts received, new data received];
    each in operation order, empty ones skipped by the caller.

    Note [negotiation inside a batch]: how NCCL runs a group of p2p operations decides what can
    deadlock. Between two ranks, transfers in one direction are matched in posting order. Inside a
    group NCCL pairs the e-th send to a peer with the e-th receive from it into one step ("epoch",
    `scheduleP2pTasksToPlan`), runs the steps one after another, and a step ends when all its
    transfers have met their counterparts; groups on a communicator run one after another too. So
    a group with two transfers to the same peer in one direction is two steps, and the first can
    wait for something the peer only does after the second.

    A receiver must know a message's layout before it can post the data receive; a sender knows
    the layout only once the compute that produced it has run, so layouts travel inside the batch
    of a key's first message. The batch is therefore posted as the group the steady state posts —
    the data of every key already known, exactly as in every later batch — followed, only for keys
    used for the first time, by one group each of: the layouts this rank sends, the new keys' data
    it sends, the layouts it receives (the host waits for them and decodes them), the new keys'
    data it receives. Nothing waits for a layout except the data it describes, and the steady-state
    group never changes shape. Both ends of a channel order its messages the same way — known data,
    layouts, new data — so the k-th send meets the k-th receive (a layout also carries its key's
    `channel_code`, checked on arrival). From the first batch on that knows every key (the second,
    and every steady-state step) a batch is exactly one group.

    Rejected: posting layouts in one group with the data (the old design: layouts and sends, then
    the data receives) or with the other layouts. Both put a layout receive in a step before a data
    send to the same peer, and on 2 stages with 1 micro-batch stage 0's first batch [send act 0,
    recv grad 0] then waits for grad 0's layout, which stage 1 can only send after computing on act
    0, which stage 0 sends in a later step. tests/unit/test_pipe_transport.py replays every schedule
    of schedules.py (1F1B, interleaved, fill-drain; 2-8 stages, 1-16 micro-batches, 1-3 chunks,
    two batches) through this plan in that model of NCCL and in a looser one (a group's transfers
    independent) and finds every message matched and no deadlock; it finds the old design's.
    """
    known: list[Transfer] = []
    layouts_out: list[Transfer] = []
    new_out: list[Transfer] = []
    layouts_in: list[Transfer] = []
    new_in: list[Transfer] = []
    fresh: set = set()  # (kind, key) whose layout this batch carries
    for i, op in enumerate(ops):
        kind = "send" if isinstance(op, SendOp) else "recv"
        if op.key in (sent if kind == "send" else received):
            known.append(Transfer(kind, "data", i))
            continue
        if (kind, op.key) not in fresh:
            fresh.add((kind, op.key))
            (layouts_out if kind == "send" else layouts_in).append(Transfer(kind, "layout", i))
        (new_out if kind == "send" else new_in).append(Transfer(kind, "data", i))
    return [known, layouts_out, new_out, layouts_in, new_in]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous `t`, sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


_ALIGN = 16  # bytes: every packed tensor starts where any dtype may view it


def packed_offsets(meta: MessageMeta) -> tuple[list[int], int]:
    """Byte offset of each tensor of a packed message, and the packed size.

    Note [one transfer per message]: NCCL runs the e-th send to a peer with the e-th receive from it
    (Note [negotiation inside a batch]). Were a tuple's tensors separate transfers, stage 0's 1F1B
    batch [send (hidden, mask), receive grad] would run as steps (hidden, grad), (mask): the gradient
    needs stage 1 to have the mask, which waits for the step after — a deadlock. One transfer per
    message keeps NCCL's steps the schedule's messages, which the schedules are checked against.
    """
    offsets, total = [], 0
    for t in meta.tensors:
        offsets.append(total)
        total += -(-math.prod(t.shape) * t.dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, total


def pack(tensors: list[torch.Tensor], meta: MessageMeta) -> torch.Tensor | None:
    """The bytes one message travels as (a lone tensor's own, else a packed copy); None for no tensors."""
    if len(tensors) <= 1:
        return _wire(tensors[0]) if tensors else None
    offsets, total = packed_offsets(meta)
    out = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, off in zip(tensors, offsets):
        b = _wire(t)
        out[off : off + b.numel()].copy_(b)
    return out


def unpack(buf: torch.Tensor, meta: MessageMeta) -> list[torch.Tensor]:
    """The tensors of a packed message (each its own copy, so autograd sees independent leaves)."""
    offsets, _ = packed_offsets(meta)
    return [
        buf[off : off + math.prod(t.shape) * t.dtype.itemsize].view(t.dtype).view(t.shape).clone()
        for t, off in zip(meta.tensors, offsets)
    ]


class Transport:
    """Runs batches of sends and receives for one rank; caches message layouts by key."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sent: dict[tuple, MessageMeta] = {}
        self._received: dict[tuple, MessageMeta] = {}
        self._warm = False

    def reset(self) -> None:
        """Forget negotiated layouts (call on every rank when message shapes change)."""
        self._sent.clear()
        self._received.clear()

    def run(self, ops: list[SendOp | RecvOp]) -> list[Any]:
        """Post the batch (one group once its keys are known: Note [negotiation inside a batch]) and
        wait; returns the received values (None for sends)."""
        if not self._warm:  # every rank's first batch: no p2p has happened yet anywhere
            warm_up(device=self.device)
            self._warm = True
        groups = plan(ops, self._sent, self._received)
        sends = self._outgoing(ops)
        received: dict[int, list[torch.Tensor] | torch.Tensor] = {}
        handles, posted = [], []  # `posted` keeps every tensor in flight alive until the waits
        for part in groups:
            wires, layouts = [], []
            for tr in part:
                op = ops[tr.op]
                if tr.what == "layout" and tr.kind == "send":
                    wires.append(("send", encode(self._sent[op.key], op.key).to(self.device), op.peer))
                elif tr.what == "layout":
                    layouts.append((op, torch.zeros(META_LEN, dtype=torch.int64, device=self.device)))
                    wires.append(("recv", layouts[-1][1], op.peer))
                elif tr.kind == "send":
                    if sends[tr.op] is not None:  # a message of no tensors moves nothing
                        wires.append(("send", sends[tr.op], op.peer))
                elif (buf := self._receive_into(tr.op, op, received)) is not None:
                    wires.append(("recv", buf, op.peer))
            handles += comm.batch_isend_irecv(wires)
            posted += wires
            if layouts:  # the new keys' data receives (next group) need these decoded first
                for h in handles[len(handles) - len(wires) :]:
                    h.wait()
                for op, buf in layouts:
                    self._learn(op, buf.cpu())
        for h in handles:
            h.wait()
        for i, got in received.items():
            if isinstance(got, torch.Tensor):  # a tuple, packed (Note [one transfer per message])
                received[i] = unpack(got, self._received[ops[i].key])
        return self._values(ops, received)

    def _outgoing(self, ops) -> dict[int, torch.Tensor]:
        """Each send's bytes (Note [one transfer per message]); a new key's layout is cached, a known one checked."""
        out = {}
        for i, op in enumerate(ops):
            if not isinstance(op, SendOp):
                continue
            meta = describe(op.value, f"message {op.key}")
            if op.key not in self._sent:
                self._sent[op.key] = meta
            elif meta.tensors != self._sent[op.key].tensors:
                raise RuntimeError(
                    f"pipeline message {op.key} changed layout from {self._sent[op.key]} to "
                    f"{meta}: shapes are negotiated once; keep micro-batch shapes fixed or "
                    "call engine.reset_activation_shape() on every rank"
                )
            _, items = as_tensors(op.value, f"message {op.key}")
            out[i] = pack([t.detach().contiguous() for t in items], meta)
        return out

    def _learn(self, op: RecvOp, buf: torch.Tensor) -> None:
        code = int(buf[-1])
        if code != channel_code(op.key):
            raise RuntimeError(
                f"pipeline message {op.key}: the layout that arrived from rank {op.peer} belongs to "
                "another channel (the two stages ran different schedules or message orders)"
            )
        self._received[op.key] = decode(buf)

    def _receive_into(self, i: int, op: RecvOp, received: dict) -> torch.Tensor | None:
        """Allocate what operation `i` (its layout known) receives into; returns its bytes (None: nothing).

        A lone tensor is received in place (`received[i]` its list); a tuple into one packed buffer
        (`received[i]` the buffer, unpacked after the wait)."""
        meta = self._received[op.key]
        if not meta.tensors:
            received[i] = []
            return None
        if len(meta.tensors) == 1:
            t = meta.tensors[0]
            received[i] = [torch.empty(t.shape, dtype=t.dtype, device=self.device)]
            return _wire(received[i][0])
        received[i] = torch.empty(packed_offsets(meta)[1], dtype=torch.uint8, device=self.device)
        return received[i]

    def _values(self, ops, received: dict[int, list[torch.Tensor]]) -> list[Any]:
        out = []
        for i, op in enumerate(ops):
            if isinstance(op, SendOp):
                out.append(None)
                continue
            items, meta = received[i], self._received[op.key]
            for t, m in zip(items, meta.tensors):
                t.requires_grad_(m.requires_grad and t.is_floating_point())
            out.append(tuple(items) if meta.is_tuple else items[0])
        return out
