"""Point-to-point transfers (pipeline activations and gradients) through the comm gateway.

Peers are global ranks. Sends and receives are counted in `STATS` under "send" / "recv" with their
payload bytes. `batch_isend_irecv` posts a list of operations together and returns one handle per
operation: NCCL gets a single fused group (`ncclGroupStart/End`: a send and a receive between two
ranks that are posted together cannot block each other — NCCL runs the e-th send to a peer together
with the e-th receive from it, step after step; see Note [negotiation inside a batch] in
parallel/pipeline/transport.py for what that means for the order of operations), gloo gets the
individual non-blocking calls.

Note [one path for NCCL point-to-point]: PyTorch runs a coalesced batch of p2p operations on the
group's communicator but a lone `isend`/`irecv` on a separate two-rank communicator, and NCCL
orders transfers per communicator only. So that every transfer between two ranks stays in one FIFO,
on NCCL every function here (`send`, `recv`, `isend`, `irecv` too) goes through a batch; a batch's
single completion object is shared by the handles of all its operations. NCCL also wants every
tensor contiguous and on this rank's GPU: anything else is refused here, by name, instead of failing
(or hanging) inside NCCL. Before a group's first batch, `warm_up(group)` lets every rank of the
group create its communicator together (PyTorch leaves a first call made by a subset of the ranks
undefined).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerospeed.accelerator import get_accelerator
from zerospeed.comm.backend import STATS, Handle, get_local_rank

P2POp = tuple[str, torch.Tensor, int]  # ("send" | "recv", tensor, peer global rank)


def _record(kind: str, tensor: torch.Tensor, start: float):
    # world_size 2: one sender, one receiver; the gateway's wire model is for collectives.
    return lambda: STATS.record(kind, tensor.nbytes, time.perf_counter() - start, 2)


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _check_nccl(ops: list[P2POp]) -> None:
    for kind, t, peer in ops:
        if t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(
                f"NCCL {kind} with rank {peer}: the tensor must be contiguous and on this rank's GPU, "
                f"got a {'non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} tensor on "
                f"{t.device} of shape {tuple(t.shape)}; move it with .to(device) / .contiguous()"
            )


def warm_up(group=None, device: torch.device | None = None) -> None:
    """Create `group`'s NCCL communicator with every rank taking part (a one-element all-reduce on
    `device`, default this rank's GPU). Call it on every rank of the group at the same point, before
    its first p2p batch; a no-op on gloo."""
    if not _is_nccl(group) or dist.get_world_size(group) == 1:
        return
    device = device if device is not None else get_accelerator().torch_device(get_local_rank())
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Blocking receive into `tensor` from global rank `src`."""
    irecv(tensor, src, group).wait()


def isend(tensor: torch.Tensor, dst: int, group=None) -> Handle:
    """Non-blocking send; keep `tensor` alive and unchanged until the handle is waited on."""
    if _is_nccl(group):  # Note [one path for NCCL point-to-point]
        return batch_isend_irecv([("send", tensor, dst)], group)[0]
    start = time.perf_counter()
    return Handle(dist.isend(tensor, dst=dst, group=group), _record("send", tensor, start))


def irecv(tensor: torch.Tensor, src: int, group=None) -> Handle:
    """Non-blocking receive into `tensor`; read it only after the handle is waited on."""
    if _is_nccl(group):
        return batch_isend_irecv([("recv", tensor, src)], group)[0]
    start = time.perf_counter()
    return Handle(dist.irecv(tensor, src=src, group=group), _record("recv", tensor, start))


def batch_isend_irecv(ops: list[P2POp], group=None) -> list[Handle]:
    """Post every operation of `ops` together; one handle per operation, in order.

    Between two ranks, operations in the same direction are matched in the order they are posted
    (across batches too); each batch on NCCL is one group that completes as a whole, so waiting on
    any of its handles waits for all of them (on the GPU stream: read results after `wait()`).
    """
    if not ops:
        return []
    start = time.perf_counter()
    if _is_nccl(group):
        _check_nccl(ops)
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group) for kind, t, peer in ops]
        works = dist.batch_isend_irecv(p2p)
        # A coalesced NCCL batch returns one work for the whole group (older PyTorch: one per op).
        if len(works) == len(ops):
            return [Handle(w, _record(kind, t, start)) for w, (kind, t, _) in zip(works, ops)]
        group_work = _GroupWork(works)
        return [Handle(group_work, _record(kind, t, start)) for kind, t, _ in ops]
    return [isend(t, peer, group) if kind == "send" else irecv(t, peer, group) for kind, t, peer in ops]


class _GroupWork:
    """The completion of a fused group, shared by its operations' handles (each wait orders the
    caller's current stream after the group; waiting again is harmless)."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
