"""ZeRO-Infinity parameter offload: stage-3 parameter shards live in an NVMe swap file.

A shard comes into memory only to be all-gathered: the shards of one gather batch are read
asynchronously (one request when their slots are consecutive), into one buffer of a fixed pool
(`offload_param.buffer_count` buffers of
`offload_param.buffer_size` elements), and the buffer returns to the pool as soon as the collective
completes (or, on an accelerator, as soon as the shards were copied to the device). After the
optimizer step each updated shard is written back through a pool buffer. Memory for parameter
shards is therefore `buffer_count x buffer_size` elements, whatever the model size.

When every buffer is held by a gather still in flight, the oldest of those gathers is completed
first: every rank issues the same gathers in the same order, so this never deadlocks.

A shard stored block-quantized (FlatParam.store_quantized: frozen weights under
`zero_quantized_nontrainable_weights`, ZeRO-Inference's quantized layers) has a uint8 slot of its
stored bytes under the key ("q", index) and is read as those bytes into a pool buffer (the buffer's
elements viewed as bytes), so a gather reads ~1/2 (int8) or ~1/4 (int4) of fp16's bytes. Quantized
after the swap file was written (ZeRO-Inference quantizes once the engine exists), the unit's first
slot stays reserved in the file, unread.
"""

from __future__ import annotations

import torch

from zerospeed.offload.aio import DIRECT_ALIGN
from zerospeed.offload.swap import BufferPool, SwapFile
from zerospeed.utils.errors import ConfigError


class NvmeParamSwapper:
    kind = "nvme"

    def __init__(
        self,
        fps: list,
        *,
        directory,
        rank: int,
        aio,
        buffer_count: int,
        buffer_size: int,
        dtype: torch.dtype,
        pin: bool = False,
    ):
        if buffer_count < 1:
            raise ConfigError(
                "zero_optimization.offload_param.buffer_count=0: parameter offload to NVMe needs at "
                "least one buffer; set it to 1 or more (default 5)"
            )
        self._itemsize = torch.tensor([], dtype=dtype).element_size()
        self._align = max(1, DIRECT_ALIGN // self._itemsize)
        self.dtype = dtype
        worst = max(fps, key=self._elems) if fps else None
        needed = self._padded(self._elems(worst)) if worst is not None else 0
        if needed > buffer_size:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size={buffer_size} is too small for the largest parameter "
                f"shard ({worst.shard_numel} elements, {needed} once aligned to 4 KiB for O_DIRECT: flat parameter "
                f"{worst.index}, shapes {[tuple(s) for s in worst.shapes][:3]}); set buffer_size to at least {needed}"
            )
        self.buffer_size = buffer_size
        self.file = SwapFile(directory, f"rank{rank}_params", aio)
        for fp in fps:
            self.file.reserve(*self._slot(fp))
        self.file.allocate()
        requests = [self.file.write(self._slot(fp)[0], fp.shard.reshape(-1)) for fp in fps]
        for r in requests:
            r.wait()
        for fp in fps:
            fp.shard = None
            fp.swap = self
        self.pool = BufferPool(buffer_count, buffer_size, dtype, pin=pin)
        self.free = buffer_count
        self.holders: list = []  # gather batches holding a buffer, oldest first
        self.unlaunched: list = []  # batches whose reads are issued and collectives not yet (creation order)

    def split(self, fps: list) -> list[list]:
        """Consecutive runs of `fps` whose shards fit one pool buffer: one gather batch each."""
        parts, cur, total = [], [], 0
        for fp in fps:
            if cur and total + self._padded(self._elems(fp)) > self.buffer_size:
                parts.append(cur)
                cur, total = [], 0
            cur.append(fp)
            total += self._padded(self._elems(fp))
        return parts + ([cur] if cur else [])

    def _acquire(self, numel: int) -> torch.Tensor:
        while self.free == 0:
            self.holders[0].wait()  # completes the oldest gather, which returns its buffer
        self.free -= 1
        return self.pool.acquire(numel)

    def _padded(self, n: int) -> int:
        return -(-n // self._align) * self._align

    def _slot(self, fp) -> tuple:
        """(key, numel, dtype) of the slot holding `fp`'s shard as stored."""
        if fp.stored is not None:
            return ("q", fp.index), fp.stored_nbytes, torch.uint8
        return fp.index, fp.shard_numel, self.dtype

    def _elems(self, fp) -> int:
        """Pool elements `fp`'s stored shard takes."""
        if fp.stored is not None:
            return -(-fp.stored_nbytes // self._itemsize)
        return fp.shard_numel

    def _view(self, fp, elems: torch.Tensor) -> torch.Tensor:
        """The pool elements reserved for `fp` as the tensor its slot reads into."""
        return elems.view(torch.uint8)[: fp.stored_nbytes] if fp.stored is not None else elems

    def read_shard(self, fp) -> torch.Tensor:
        """`fp`'s (unquantized) shard, read now."""
        key, numel, dtype = self._slot(fp)
        out = torch.empty(numel, dtype=dtype)
        self.file.read(key, out).wait()
        return out

    def write_packed(self, fp, packed: torch.Tensor) -> None:
        """Write the stored bytes of a quantized shard (a slot of their own, reserved on first use)."""
        self.file.reserve(("q", fp.index), packed.numel(), torch.uint8)
        self.file.write(("q", fp.index), packed.reshape(-1).cpu()).wait()

    def begin_read(self, fps: list, holder) -> tuple[torch.Tensor, list[torch.Tensor], list]:
        """Start reading the shards of `fps` into one pool buffer held by `holder` (a gather batch,
        queued to launch in creation order): (the buffer, one view per shard, the read requests)."""
        buf = self._acquire(sum(self._padded(self._elems(fp)) for fp in fps))
        self.holders.append(holder)
        self.unlaunched.append(holder)
        views, off = [], 0
        for fp in fps:
            views.append(self._view(fp, buf[off : off + self._elems(fp)]))
            off += self._padded(self._elems(fp))
        keys = [self._slot(fp)[0] for fp in fps]
        if self.file.run_nbytes(keys) == off * buf.element_size():  # consecutive slots: one request
            return buf, views, [self.file.read_run(keys, buf[:off])]
        return buf, views, [self.file.read(k, v) for k, v in zip(keys, views)]

    def launch_through(self, batch=None) -> None:
        """Launch queued batches in creation order, up to and including `batch` (None: all)."""
        while self.unlaunched:
            nxt = self.unlaunched.pop(0)
            nxt.launch()
            if nxt is batch:
                return

    def release(self, buf: torch.Tensor, holder) -> None:
        self.pool.release(buf)
        self.free += 1
        self.holders.remove(holder)

    def write_shard(self, fp, values: torch.Tensor) -> None:
        """Write `values` (any device/dtype) as `fp`'s shard."""
        self.write_shards([fp], [values])

    @torch.no_grad()
    def write_shards(self, fps: list, values: list[torch.Tensor]) -> None:
        """Write many shards (after a step): packed into pool buffers at their 4 KiB-aligned layout,
        one request per run of consecutive slots, several buffers in flight; returns when all are on disk."""
        if any(fp.stored is not None for fp in fps):
            raise ValueError("write_shards: a quantized shard is written as its stored bytes (write_packed)")
        pending: list = []  # (buffer, requests)
        i = 0
        while i < len(fps):
            run, total = [], 0
            while i < len(fps) and total + self._padded(fps[i].shard_numel) <= self.buffer_size:
                if run and fps[i].index != run[-1][0].index + 1:
                    break
                run.append((fps[i], values[i]))
                total += self._padded(fps[i].shard_numel)
                i += 1
            if self.free == 0:
                self._finish(*pending.pop(0))
            buf = self._acquire(total)
            off = 0
            for fp, v in run:
                buf[off : off + fp.shard_numel].copy_(v.reshape(-1))
                off += self._padded(fp.shard_numel)
            keys = [fp.index for fp, _ in run]
            if self.file.run_nbytes(keys) == total * buf.element_size():
                reqs = [self.file.write_run(keys, buf[:total])]
            else:
                reqs, off = [], 0
                for fp, _ in run:
                    reqs.append(self.file.write(fp.index, buf[off : off + fp.shard_numel]))
                    off += self._padded(fp.shard_numel)
            pending.append((buf, reqs))
        for p in pending:
            self._finish(*p)

    def _finish(self, buf: torch.Tensor, reqs: list) -> None:
        for r in reqs:
            r.wait()
        self.pool.release(buf)
        self.free += 1

    def files(self) -> list:
        return [("parameters", self.file.path, self.file.nbytes)]

    def buffer_bytes(self) -> int:
        return self.pool.nbytes

    def close(self) -> None:
        self.file.close()
