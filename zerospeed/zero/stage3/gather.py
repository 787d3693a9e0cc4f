"""All-gathers of one or more stage-3 flat parameters as one collective, with the divergence check.

Several flat parameters gathered together (a prefetch of upcoming units, or a module that uses
several) travel as one all-gather of their concatenated shards: on gloo (and for small units on
NCCL) a collective's fixed latency, not its bytes, dominates, and a transformer has dozens of units.
Each rank's result is copied out of the rank-major receive buffer into every parameter's own full
buffer once the collective completes.

Note [NVMe reads ahead of the gather]: with `offload_param: nvme` a batch first only issues the
asynchronous reads of its shards; its collectives are issued later, at points fixed by program
order — when the next gathers are started (`start_gathers`), or when this batch (or a later one) is
waited on — in the order the batches were created. Every rank therefore issues the same collectives
in the same order, while a prefetched unit's reads overlap the compute of the module before it.

Note [one-rank gathers]: over a group of one rank (ZeRO-Inference on one process, offload to CPU or
NVMe) a batch copies each shard straight into its parameter's own full buffer: one copy of the bytes.
The general path would concatenate the shards, "all-gather" them (another copy) and clone each
parameter out of the receive buffer (a third), and the divergence check has nobody to compare with.
A shard stored quantized is moved to the device as stored and decoded there into the full buffer,
with no collective: the general path's code all-gather waits for its result on the host (`tolist`),
which on a GPU stalls the host for every unit (measured: int8 ZeRO-Inference at 11x one read of the
model per token, on an H200 with the stored bytes pageable, before this and the pinned shards).

Note [asynchronous host-to-device gathers]: on one rank with `offload_param: cpu` (ZeRO-Inference) a
gather is a host-to-device copy. A blocking copy would keep the host from queueing the next modules'
kernels and copies until it lands, so the device would idle for the host's hook and launch overhead
on every unit. A frozen shard in pinned memory is copied with `non_blocking`: the copy is queued on the
current stream, ahead of the kernels that read the full buffer, so stream order alone makes it safe;
no optimizer writes a frozen shard, and the rare host-side writes (loading a checkpoint's frozen
values) first wait for the device (`FlatParam._write_pinned_guard`); a dropped shard goes back to
torch's pinned-memory cache, which reuses it only after the copies that read it; the full buffer is
device memory from the caching allocator, which reuses it only in the stream's order. A trainable
shard is copied blocking (the CPU optimizer writes it in place), and so is a view into a swap pool
buffer (released, and refilled by the next read, right after the copy). Copies and kernels share the
stream, so the device still runs a unit's copy and the kernels before it in order: what this buys is
a host that never waits (measured on an H200: 1.10-1.13x one read of the model per token); a side
copy stream would also hide the kernels' time under the copies (not done: it needs a GPU to test).

Note [stage-3 divergence check]: with every gather each rank also all-gathers a code of *which* flat
parameters it is gathering (8 bytes). Ranks whose forward took different branches would otherwise
exchange chunks of different parameters without noticing when the sizes happen to agree; now they
stop with an error that says so. An exact gather sends the code with the shards (`comm.backend.
all_gather_coalesced`: one exchange on gloo, Note [gloo all-gathers as exchanges]; two collectives
elsewhere), counted as its own all-gather either way.

Note [ZeRO++ gather routes]: a batch travels one of three `Route`s. EXACT: the shards as they are,
over the flat parameters' data-parallel group (every gather outside training: zero.Init,
GatheredParameters, state dicts, persistent units). QUANTIZED (qwZ, training fetches): the shards
block-quantized to int8 on the wire, dequantized into the full buffer. SECONDARY (hpZ, training
fetches of a unit that holds a secondary shard, i.e. gathered once since the weights last changed):
the secondary shards (1/H of the unit each) all-gathered over the hpZ sub-group of H ranks only, in
the parameter dtype. The secondary shard is cut from the first primary gather's result, so forward
and backward see the same (possibly quantized) weights. STORED (every gather of a frozen flat
parameter stored int8, `zero_quantized_nontrainable_weights`, except hpZ's training fetches from a
secondary shard): the stored int8 shard exchanged as it is, one flat parameter per collective.
"""

from __future__ import annotations

import enum
import functools

import torch

from zerospeed import comm
from zerospeed.comm import zeropp
from zerospeed.comm.backend import all_gather_coalesced


class Route(enum.Enum):
    EXACT = "exact"
    QUANTIZED = "quantized"
    SECONDARY = "secondary"
    STORED = "stored"


def _code(indices: list[int]) -> float:
    code = 0
    for i in indices:
        code = (code * 1_000_003 + i + 1) % (1 << 52)  # exact in float64
    return float(code)


class GatherBatch:
    def __init__(self, fps: list, route: Route = Route.EXACT) -> None:
        self.fps = fps
        first = fps[0]
        self.route = route
        self.device = first.device
        if route is Route.SECONDARY:  # Note [ZeRO++ gather routes]
            self.group, self.world = first.hpz.handle, first.hpz.size
            self.chunks = [fp.padded // self.world for fp in fps]
        else:
            self.group, self.world = first.dp_group, first.layout.world_size
            self.chunks = [fp.layout.chunk for fp in fps]
        self.swap_buffer = None
        self.done = False
        if route is Route.SECONDARY:
            self._launch(first.secondary if len(fps) == 1 else torch.cat([fp.secondary for fp in fps]))
            return
        if first.swap is not None:  # Note [NVMe reads ahead of the gather]
            self.swap_buffer, self.views, self.reads = first.swap.begin_read(fps, self)
            self.launched = False
            return
        if self._local():
            self._copy_local([fp.shard for fp in fps])
            return
        self._launch(first.shard if len(fps) == 1 else torch.cat([fp.shard for fp in fps]))

    def _local(self) -> bool:
        """Note [one-rank gathers]: an exact or stored gather over a group of one rank is a copy (and a
        decode) of each shard."""
        return self.world == 1 and self.route in (Route.EXACT, Route.STORED)

    def _copy_local(self, shards: list[torch.Tensor]) -> None:
        for fp, shard in zip(self.fps, shards):
            fp.full = fp.full_buffer()
            if self.route is Route.STORED:  # the codes travel as stored and are decoded where they are used
                packed = shard.to(self.device, non_blocking=self._async_copy(fp, shard))
                zeropp.decode_packed(packed, fp.full, fp.layout.chunk, *fp.stored)
            else:
                fp.full.copy_(shard, non_blocking=self._async_copy(fp, shard))
        self._release_swap_buffer()
        self.launched = self.done = True

    def _async_copy(self, fp, shard: torch.Tensor) -> bool:
        """Note [asynchronous host-to-device gathers]: a frozen shard in pinned host memory (not a swap
        pool buffer, which is reused as soon as it is released) is copied without blocking the host."""
        return (
            self.device.type != "cpu"
            and fp.master is None
            and self.swap_buffer is None
            and shard.device.type == "cpu"
            and shard.is_pinned()
        )

    def launch(self) -> None:
        """NVMe-backed batches: wait for the shard reads, then issue the collectives."""
        if self.launched:
            return
        for r in self.reads:
            r.wait()
        views, self.views, self.reads = self.views, None, None
        if self._local():
            self._copy_local(views)
            return
        send = views[0] if len(views) == 1 else torch.cat(views)
        if len(views) > 1:  # the concatenation is a copy: the pool buffer can go back now
            self._release_swap_buffer()
        self._launch(send)

    def _launch(self, send: torch.Tensor) -> None:
        first, device, world = self.fps[0], self.device, self.world
        if send.device != device:  # offloaded shards travel to the device for the collective
            send = send.to(device)
            self._release_swap_buffer()
        if len(self.fps) == 1:
            first.full = first.full_buffer()
            self.recv = first.full
        else:
            self.recv = torch.empty(world * send.numel(), dtype=first.dtype, device=device)
        self.tags = torch.empty(world, dtype=torch.float64, device=device)
        mine = torch.tensor([_code([fp.index for fp in self.fps])], dtype=torch.float64, device=device)
        if self.route is Route.EXACT:  # the code travels with the shards where the backend allows (gloo)
            self.handle = self.tag_handle = all_gather_coalesced(
                [self.recv, self.tags], [send, mine], group=self.group, async_op=True
            )
            self.launched = True
            return
        gather = {
            Route.QUANTIZED: zeropp.all_gather_quantized,
            Route.SECONDARY: zeropp.all_gather_secondary,
            Route.STORED: functools.partial(
                zeropp.all_gather_packed,
                numel=first.layout.chunk,
                bits=first.stored[0],
                block_size=first.stored[1],
                symmetric=first.stored[2],
            )
            if first.stored
            else None,
        }[self.route]
        self.handle = gather(self.recv, send, group=self.group, async_op=True)
        # (over the hpZ sub-group the code is counted with the sub-group's bytes: all_gather_hpz)
        tag = zeropp.all_gather_secondary if self.route is Route.SECONDARY else comm.all_gather_into_tensor
        self.tag_handle = tag(self.tags, mine, group=self.group, async_op=True)
        self.launched = True

    def wait(self) -> None:
        if self.done:
            return
        if not self.launched:
            self.fps[0].swap.launch_through(self)  # earlier NVMe batches first: the same order on every rank
            if self.done:  # Note [one-rank gathers]
                return
        self.handle.wait()
        self.tag_handle.wait()
        self.done = True
        self._release_swap_buffer()
        codes = self.tags.tolist()
        if any(c != codes[0] for c in codes):
            raise RuntimeError(
                "ZeRO stage 3: ranks gathered different parameters at the same point (this rank: flat parameters "
                f"{[fp.index for fp in self.fps]}). The ranks ran different modules in forward or backward (data- or "
                "rank-dependent branches). Stage 3 needs every rank to use the same modules in the same order; "
                "use ZeRO stage 0-2 for such models."
            )
        if len(self.fps) > 1:
            rows = self.recv.view(self.world, -1)
            offset = 0
            for fp, chunk in zip(self.fps, self.chunks):
                fp.full = fp.full_buffer()
                fp.full.view(self.world, chunk).copy_(rows[:, offset : offset + chunk])
                offset += chunk
        self.recv = None

    def _release_swap_buffer(self) -> None:
        if self.swap_buffer is not None:
            self.fps[0].swap.release(self.swap_buffer, self)
            self.swap_buffer = None
