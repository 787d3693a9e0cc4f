"""1-bit compressed all-reduce with error feedback (the collective of 1-bit Adam, 0/1 Adam and 1-bit LAMB).

Each rank turns its tensor into one scale and a sign per element; the average of the ranks' tensors
is rebuilt from those, in two phases (arXiv 2102.02888, section 4):

1. worker: x = buffer + worker_error; scale = ||x||_2 / sqrt(n); sign(x) in {-1, +1} (0 counts as +1);
   worker_error = x - scale * sign(x). The signs are packed 8 to a byte and cut into one chunk per
   rank: an all-to-all gives rank r chunk r of every rank's signs, an all-gather every rank's scale.
2. server (rank r, for its chunk): y = mean over ranks of scale_k * sign_k + server_error;
   s = ||y||_2 / sqrt(n / world); server_error = y - s * sign(y). The packed signs of y and s are
   all-gathered: every rank rebuilds the whole result, chunk r = s_r * sign(y_r).

The errors carry what compression dropped into the next call, so nothing is lost over time, only
delayed. Tensors are padded with zeros to `padded_size(n, world)` — a multiple of world * lcm(world, 8),
so every rank's chunk is whole bytes — and the errors have the padded sizes (worker: padded, server:
padded / world), as DeepSpeed's buffers do. Wire bytes per rank, fp32 scales, N ranks, n elements
(padded): phase 1 sends (N-1)/N * n/8 + (N-1)*4 bytes, phase 2 the same: 2(N-1)/N * n/8 + 8(N-1) in
all, against an fp32 ring all-reduce's 2(N-1)/N * 4n — 1/32 of it plus the scales. The collectives go
through the gateway (`all_to_all_single`, `all_gather_into_tensor`), which counts those exact bytes,
on whatever backend the job runs (gloo, NCCL). `compressed_allreduce_many` compresses several tensors
(each with its own scales and errors, as if alone) in the same four collectives.
"""

from __future__ import annotations

import math

import torch

from zerospeed.comm import backend

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def padded_size(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of world * lcm(world, 8) (whole bytes per rank's chunk)."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


def signs(x: torch.Tensor) -> torch.Tensor:
    """+1 where x >= 0, -1 elsewhere (float, like x): 1-bit compression has no zero."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of flat `x` (1 for x >= 0), most significant bit first; len(x) % 8 == 0."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs: {x.numel()} elements is not a multiple of 8")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +1 / -1 values `pack_signs` packed (8 per byte), flat."""
    bits = (packed.reshape(-1, 1) & _BITS.to(packed.device)) != 0
    return torch.where(bits.reshape(-1), 1.0, -1.0).to(dtype)


def _scale(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x) / math.sqrt(x.numel())


def compressed_allreduce(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group=None
) -> torch.Tensor:
    """The 1-bit estimate of the mean of `buffer` over `group` (a new tensor shaped like `buffer`);
    `worker_error` (padded size) and `server_error` (padded size / world) are updated in place.
    Collective: every rank of the group calls it with the same shapes."""
    return compressed_allreduce_many([buffer], [worker_error], [server_error], group)[0]


def compressed_allreduce_many(
    buffers: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor], group=None
) -> list[torch.Tensor]:
    """`compressed_allreduce` of each buffer (its own scales and errors), all in the same four collectives:
    rank r's chunks of every tensor travel together, and the scales as one vector per rank."""
    world = backend.get_world_size(group)
    device = buffers[0].device
    xs, scales = [], []
    for buf, worker, server in zip(buffers, worker_errors, server_errors, strict=True):
        n, padded = buf.numel(), worker.numel()
        if padded != padded_size(n, world) or server.numel() != padded // world:
            raise ValueError(
                f"compressed_allreduce: a tensor of {n} elements over {world} ranks needs a worker error "
                f"of {padded_size(n, world)} and a server error of {padded_size(n, world) // world} "
                f"elements, got {padded} and {server.numel()}"
            )
        x = torch.zeros(padded, dtype=torch.float32, device=device)
        x[:n] = buf.reshape(-1)
        x += worker
        scale = _scale(x)
        worker.copy_(x - scale * signs(x))
        xs.append(x)
        scales.append(scale)
    k = len(xs)
    chunk_bytes = [x.numel() // world // 8 for x in xs]
    # rank-major send buffer: for each destination rank, its chunk of every tensor
    send = torch.cat([pack_signs(x).reshape(world, -1) for x in xs], dim=1).reshape(-1)
    received = torch.empty_like(send)
    backend.all_to_all_single(received, send, group=group)  # phase 1: rank r gets chunk r of every rank's signs
    all_scales = torch.empty(world * k, dtype=torch.float32, device=device)
    backend.all_gather_into_tensor(all_scales, torch.stack(scales), group=group)
    from_ranks = received.reshape(world, -1).split(chunk_bytes, dim=1)
    all_scales = all_scales.reshape(world, k)
    ys, server_scales = [], []
    for i, (piece, server) in enumerate(zip(from_ranks, server_errors)):
        y = (unpack_signs(piece.reshape(-1)).reshape(world, -1) * all_scales[:, i : i + 1]).sum(dim=0) / world
        y += server
        s = _scale(y)
        server.copy_(y - s * signs(y))
        ys.append(y)
        server_scales.append(s)
    # phase 2: every rank's compressed chunk of every result, to every rank
    mine = torch.cat([pack_signs(y) for y in ys])
    chunks = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    backend.all_gather_into_tensor(chunks, mine, group=group)
    gathered_scales = torch.empty(world * k, dtype=torch.float32, device=device)
    backend.all_gather_into_tensor(gathered_scales, torch.stack(server_scales), group=group)
    gathered_scales = gathered_scales.reshape(world, k)
    outs = []
    for i, (piece, buf) in enumerate(zip(chunks.reshape(world, -1).split(chunk_bytes, dim=1), buffers)):
        out = unpack_signs(piece.reshape(-1)).reshape(world, -1) * gathered_scales[:, i : i + 1]
        outs.append(out.reshape(-1)[: buf.numel()].reshape(buf.shape).to(buf.dtype))
    return outs


def error_buffers(numel: int, world: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker_error, server_error) for a tensor of `numel` elements over `world` ranks."""
    padded = padded_size(numel, world)
    return (
        torch.zeros(padded, dtype=torch.float32, device=device),
        torch.zeros(padded // world, dtype=torch.float32, device=device),
    )


class CompressedBackend:
    """The object DeepSpeed's 1-bit optimizers talk to (DeepSpeed's `NcclBackend` / `MpiBackend` /
    `CompressedBackend` / `HcclBackend` interface): `compressed_allreduce(buffer, worker_error,
    server_error, local_rank)` over the data-parallel group (an `mpu`'s, or the world). One
    implementation whatever the backend's name: the job's own backend runs it."""

    def __init__(self, mpu=None):
        self.world_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.rank = backend.get_rank(self.world_group)
        self.size = backend.get_world_size(self.world_group)

    def compressed_allreduce(
        self,
        buffer_m: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        local_rank: int | None = None,
    ) -> torch.Tensor:
        """The 1-bit mean of `buffer_m` over the group, written back into it and returned (DeepSpeed's
        contract); the errors (padded sizes, as DeepSpeed allocates them) are updated in place."""
        buffer_m.copy_(compressed_allreduce(buffer_m, worker_error, server_error, self.world_group))
        return buffer_m


class NcclBackend(CompressedBackend):
    """DeepSpeed's `deepspeed.runtime.comm.nccl.NcclBackend` (argument `mpu`)."""


class HcclBackend(CompressedBackend):
    """DeepSpeed's `deepspeed.runtime.comm.hccl.HcclBackend` (argument `mpu`)."""


class MpiBackend(CompressedBackend):
    """DeepSpeed's `deepspeed.runtime.comm.mpi.MpiBackend` (arguments `cuda_aware`, `mpu`)."""

    def __init__(self, cuda_aware: bool = False, mpu=None):
        super().__init__(mpu)
        self.cuda_aware = cuda_aware
