"""Point-to-point transfers (pipeline activations and gradients) through the comm gateway.

Peers are global ranks. Sends and receives are counted in `STATS` under "send" / "recv" with their
payload bytes. `batch_isend_irecv` posts a list of operations together and returns one handle per
operation: NCCL gets a single fused group (so paired sends and receives between two ranks cannot
block each other), gloo gets the individual non-blocking calls, which is equivalent there.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerospeed.comm.backend import STATS, Handle

P2POp = tuple[str, torch.Tensor, int]  # ("send" | "recv", tensor, peer global rank)


def _record(kind: str, tensor: torch.Tensor, start: float):
    # world_size 2: one sender, one receiver; the gateway's wire model is for collectives.
    return lambda: STATS.record(kind, tensor.nbytes, time.perf_counter() - start, 2)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    start = time.perf_counter()
    dist.send(tensor, dst=dst, group=group)
    _record("send", tensor, start)()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Blocking receive into `tensor` from global rank `src`."""
    start = time.perf_counter()
    dist.recv(tensor, src=src, group=group)
    _record("recv", tensor, start)()


def isend(tensor: torch.Tensor, dst: int, group=None) -> Handle:
    """Non-blocking send; keep `tensor` alive and unchanged until the handle is waited on."""
    start = time.perf_counter()
    return Handle(dist.isend(tensor, dst=dst, group=group), _record("send", tensor, start))


def irecv(tensor: torch.Tensor, src: int, group=None) -> Handle:
    """Non-blocking receive into `tensor`; read it only after the handle is waited on."""
    start = time.perf_counter()
    return Handle(dist.irecv(tensor, src=src, group=group), _record("recv", tensor, start))


def batch_isend_irecv(ops: list[P2POp], group=None) -> list[Handle]:
    """Post every operation of `ops` together; one handle per operation, in order."""
    if not ops:
        return []
    start = time.perf_counter()
    if dist.get_backend(group) == "nccl":
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group) for kind, t, peer in ops]
        works = dist.batch_isend_irecv(p2p)
        return [Handle(w, _record(kind, t, start)) for w, (kind, t, _) in zip(works, ops)]
    return [isend(t, peer, group) if kind == "send" else irecv(t, peer, group) for kind, t, peer in ops]
