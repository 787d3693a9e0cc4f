"""ZeRO stage 0: data-parallel gradient averaging in buckets, overlapped with backward.

Each trainable parameter owns a slice of a flat fp32 (grad_accum_dtype) bucket buffer. A
post-accumulate-grad hook moves every fresh gradient into its slice and frees the parameter's own
.grad, so micro-batches accumulate in the buffer at full precision. On the micro-step that ends an
accumulation window, a bucket whose parameters are all ready is all-reduced asynchronously while
autograd keeps producing the gradients of earlier layers.

Note [bucket launch order]: buckets are launched strictly in index order (bucket i only after
buckets 0..i-1), whatever order their gradients become ready in. A parameter unused in this step on
one rank delays that rank's launches until `finish()`, but every rank still issues the same sequence
of collectives, so the job cannot deadlock or reduce mismatched buffers.
"""
from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.comm import assign_buckets
from zerospeed.runtime.grad_math import reduction_factors


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.handle: comm.Handle | None = None
        self.comm_buffer: torch.Tensor | None = None


class GradientAllReducer:
    """Owns the gradient buffers of stage 0 and their bucketed, overlapped all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], *, bucket_size: int, accum_dtype: torch.dtype,
                 comm_dtype: torch.dtype | None, group=None, op: str = "avg", prescale: bool = False,
                 predivide_factor: float = 1.0):
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.comm_dtype = comm_dtype
        self.pre, self.post = reduction_factors(self.world_size, op, prescale, predivide_factor)
        # Backward visits layers roughly in reverse registration order: bucket in that order so the
        # first buckets fill (and launch) first.
        ordered = list(reversed(params))
        device = ordered[0].device if ordered else torch.device("cpu")
        groups = assign_buckets([p.numel() for p in ordered], bucket_size)
        self.buckets = [_Bucket([ordered[i] for i in idx], accum_dtype, device) for idx in groups]
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.sync = False
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in ordered]

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is true on the micro-step that reduces gradients."""
        self.sync = sync
        self._next_launch = 0
        for b in self.buckets:
            b.pending = len(b.params)

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket, i = self._slot[id(param)]
        bucket.views[i].add_(param.grad)
        param.grad = None
        if self.sync:
            bucket.pending -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending <= 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.world_size == 1:
            return
        if self.pre != 1.0:
            bucket.buffer.mul_(self.pre)
        send = bucket.buffer
        if self.comm_dtype is not None and self.comm_dtype != send.dtype:
            send = send.to(self.comm_dtype)
        bucket.comm_buffer = send
        bucket.handle = comm.all_reduce(send, op="sum", group=self.group, async_op=True)

    # -- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """Launch what unused parameters held back, then wait for every bucket (before the step)."""
        if not self.sync:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            if bucket.handle is None:
                continue
            bucket.handle.wait()
            if bucket.comm_buffer is not bucket.buffer:
                bucket.buffer.copy_(bucket.comm_buffer)
            if self.post != 1.0:
                bucket.buffer.mul_(self.post)
            bucket.handle = bucket.comm_buffer = None
        self.sync = False

    def grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its reduced gradient view) for every trainable parameter."""
        return [(p, v) for b in self.buckets for p, v in zip(b.params, b.views)]

    def buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def zero(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
