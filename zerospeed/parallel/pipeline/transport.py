"""Moving activations and gradients between stages: shape negotiation and batched transfers.

A message is a tensor or a tuple of tensors. The first time a message key (kind, boundary virtual
stage, mode) is used, its layout (count, tuple-ness, per tensor: dtype, requires_grad, shape) travels
first as a small fixed-size int64 tensor; both sides cache it, and later messages with that key carry
only data. Sender and receiver agree on "first time" because each key names one channel and messages
on a channel arrive in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerospeed import comm

META_LEN = 96
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
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
            raise TypeError(f"{what}: pipeline messages must be tensors or tuples of tensors; item {i} is "
                            f"{type(t).__name__}")
    return isinstance(value, (tuple, list)), items


def describe(value: Any, what: str) -> MessageMeta:
    is_tuple, items = as_tensors(value, what)
    return MessageMeta(is_tuple, tuple(TensorMeta(t.dtype, t.requires_grad, tuple(t.shape)) for t in items))


def encode(meta: MessageMeta) -> torch.Tensor:
    """The layout as META_LEN int64s: [n, is_tuple, then per tensor: dtype, requires_grad, ndim, dims...]."""
    out = [len(meta.tensors), int(meta.is_tuple)]
    for t in meta.tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline messages cannot carry {t.dtype}; supported: {_DTYPES}")
        if len(t.shape) > _MAX_DIMS:
            raise ValueError(f"pipeline messages carry at most {_MAX_DIMS} dimensions, got shape {t.shape}")
        out += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
    if len(out) > META_LEN:
        raise ValueError(f"pipeline message layout needs {len(out)} integers, more than {META_LEN}: "
                         "send fewer tensors per message")
    return torch.tensor(out + [0] * (META_LEN - len(out)), dtype=torch.int64)


def decode(buf: torch.Tensor) -> MessageMeta:
    vals = buf.tolist()
    n, is_tuple, pos, tensors = vals[0], bool(vals[1]), 2, []
    for _ in range(n):
        dtype, rg, ndim = _DTYPES[vals[pos]], bool(vals[pos + 1]), vals[pos + 2]
        tensors.append(TensorMeta(dtype, rg, tuple(vals[pos + 3:pos + 3 + ndim])))
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


class Transport:
    """Runs batches of sends and receives for one rank; caches message layouts by key."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sent: dict[tuple, MessageMeta] = {}
        self._received: dict[tuple, MessageMeta] = {}

    def reset(self) -> None:
        """Forget negotiated layouts (call on every rank when message shapes change)."""
        self._sent.clear()
        self._received.clear()

    def run(self, ops: list[SendOp | RecvOp]) -> list[Any]:
        """Post all operations together and wait; returns the received values (None for sends).

        Note [negotiation inside a batch]: every send (layout first where new, then data) and every
        new receive's layout are posted at once; only then are the layouts awaited and the data
        receives posted. Waiting for layouts before posting this batch's sends would deadlock: the
        peer may first need our data to reach the point where it sends the layout we wait for.
        Per peer, all layouts travel before all data, in operation order, on both sides.
        """
        metas, datas, layouts = [], [], []
        for op in ops:
            if isinstance(op, SendOp):
                meta = describe(op.value, f"message {op.key}")
                if op.key not in self._sent:
                    self._sent[op.key] = meta
                    metas.append(("send", encode(meta).to(self.device), op.peer))
                elif meta.tensors != self._sent[op.key].tensors:
                    raise RuntimeError(f"pipeline message {op.key} changed layout from {self._sent[op.key]} to "
                                       f"{meta}: shapes are negotiated once; keep micro-batch shapes fixed or "
                                       "call engine.reset_activation_shape() on every rank")
                _, items = as_tensors(op.value, f"message {op.key}")
                datas += [("send", t.detach().contiguous(), op.peer) for t in items]
            elif op.key not in self._received:
                buf = torch.zeros(META_LEN, dtype=torch.int64, device=self.device)
                layouts.append((op.key, buf))
                metas.append(("recv", buf, op.peer))
        first = comm.batch_isend_irecv(metas + datas)
        for h, (kind, _, _) in zip(first, metas + datas):
            if kind == "recv":
                h.wait()
        for key, buf in layouts:
            self._received[key] = decode(buf.cpu())
        received = []
        for op in ops:
            if isinstance(op, RecvOp):
                meta = self._received[op.key]
                received.append([torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in meta.tensors])
        second = comm.batch_isend_irecv([("recv", t, op.peer) for op, items in
                                         zip([o for o in ops if isinstance(o, RecvOp)], received) for t in items])
        for h in first + second:
            h.wait()
        return self._values(ops, received)

    def _values(self, ops, received: list[list[torch.Tensor]]) -> list[Any]:
        out, it = [], iter(received)
        for op in ops:
            if isinstance(op, SendOp):
                out.append(None)
                continue
            items, meta = next(it), self._received[op.key]
            for t, m in zip(items, meta.tensors):
                t.requires_grad_(m.requires_grad and t.is_floating_point())
            out.append(tuple(items) if meta.is_tuple else items[0])
        return out
