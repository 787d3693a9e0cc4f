"""ZeRO++'s collectives: a block-quantized all-gather (qwZ), a block-quantized all-to-all
reduce-scatter (qgZ, one or two levels) and the sub-groups of hierarchical partitioning (hpZ).

Every one of them moves uint8 buffers (fp32 scales, then codes: `ops.quantizer.to_bytes`) and
counts what it really moves in `STATS`, under its own kind so that a step's traffic can be read per
kind (and so per group):

| kind                      | collective                              | payload bytes                    |
|---------------------------|-----------------------------------------|----------------------------------|
| `all_gather_int8`         | qwZ all-gather over the whole group (also of int8-stored frozen
|                           | shards)                                 | N x wire_bytes(chunk, 8)         |
| `all_gather_int4`         | all-gather of int4-stored frozen shards (ZeRO-Inference) | N x wire_bytes(chunk, 4) |
| `all_gather_hpz`          | hpZ secondary all-gather (sub-group)    | the full tensor, param dtype     |
| `reduce_scatter_int4`     | qgZ all-to-all (single level)           | N x wire_bytes(chunk, 4)          |
| `reduce_scatter_int4_intra` / `_inter` | qgZ hierarchical: within / across sub-groups | the send buffer   |

Wire bytes are the payload less the slice a rank keeps: (N - 1) / N of it, N the size of the group
the collective runs over. Each function returns a handle whose `wait()` also dequantizes into the
caller's output, so an async caller overlaps the exchange and pays the decode when it waits.

Note [hpZ sub-groups]: hpZ splits a data-parallel group of N ranks into N / H consecutive blocks of
H ranks in group-rank order (the *intra* groups: with the launcher's LOCAL_WORLD_SIZE = H and a
plain data-parallel mesh, the ranks of one node), and the *inter* groups of the ranks holding the
same position in each block. Making them is collective over the world: every rank learns every
rank's group (one all-gather of members) and all ranks create every sub-group in the same order.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerospeed.comm import backend
from zerospeed.comm.axis_groups import GroupMaker
from zerospeed.comm.backend import STATS, _check_tensors, _is_gloo, get_rank, get_world_size
from zerospeed.precision.quantize import (
    dequantize_blocks,
    dequantize_blocks_into,
    from_bytes,
    quantize_blocks,
    to_bytes,
    wire_bytes,
)

WEIGHT_BITS, WEIGHT_BLOCK = 8, 512  # qwZ: int8, one fp32 scale per 512 elements
GRAD_BITS, GRAD_BLOCK = 4, 64  # qgZ: int4, one fp32 scale per 64 elements (Note [qgZ block size])
# Note [qgZ block size]: int4 has 15 levels, so each block's step is its max |x| / 7. With 256-element
# blocks the demo GPT's 300-step loss with all three ZeRO++ switches ended 1.4-2.0% above plain ZeRO-3 on
# each of 3 seeds (qgZ alone +0.83% on average, up to +1.9%); with 64-element blocks all three ended
# -1.3 / +0.2 / +0.3% and qgZ alone +0.4 to +0.7% (docs/comm_compression.md, benchmarks/compression_
# convergence.py). The finer scales cost 4 / 64 bytes per element: 0.281 of the bf16 reduce-scatter's
# bytes instead of 0.258. DeepSpeed sizes its qgZ groups by the tensor's largest dimension (a 32-wide
# model's groups are 32-128 elements, a 4096-wide one's 4096).


class _Decoding:
    """An in-flight exchange; `wait()` completes it, counts it, then runs `finish` (the decode).
    `finish_communicates`: `finish` runs another exchange (hierarchical qgZ's second level)."""

    def __init__(self, work, record, finish, finish_communicates: bool = False):
        self._work, self._record, self._finish = work, record, finish
        self._finish_communicates = finish_communicates

    def done(self) -> bool:
        """`wait()` would not block: the exchange has completed and its decode is local (a second
        level still to run counts as not done, so that every rank runs it in the same order)."""
        return self._work is None or (not self._finish_communicates and self._work.is_completed())

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        self._record()
        self._finish()


def _done(finish, async_op: bool):
    finish()
    return _Decoding(None, None, None) if async_op else None


def _launch(
    kind: str, payload: int, wire: float, group, launch, finish, async_op: bool, finish_communicates: bool = False
):
    """Issue `launch(async_op=True)` (a blocking caller waits here), count it, decode on wait."""
    start = time.perf_counter()
    world = get_world_size(group)
    work = launch(True)

    def record():
        STATS.record(kind, payload, time.perf_counter() - start, world, wire_bytes=wire)

    handle = _Decoding(work, record, finish, finish_communicates)
    if async_op:
        return handle
    handle.wait()
    return None


def _gather_bytes(recv: torch.Tensor, send: torch.Tensor, group, async_op: bool):
    world = get_world_size(group)
    if _is_gloo(group):  # gloo's list form, as in backend.all_gather_into_tensor
        return dist.all_gather(list(recv.view(-1).chunk(world)), send, group=group, async_op=async_op)
    return backend._all_gather_tensor(recv, send, group=group, async_op=async_op)


# -- qwZ ---------------------------------------------------------------------------------------------
def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    bits: int = WEIGHT_BITS,
    block_size: int = WEIGHT_BLOCK,
):
    """`all_gather_into_tensor` of block-quantized shards: rank r's `input` (equal sizes on every rank),
    quantized symmetric to `bits` per element, lands dequantized in slice r of `output`. One group
    gathers exactly (no quantization) — nothing crosses a wire."""
    if get_world_size(group) == 1:
        return _done(lambda: output.view(-1).copy_(input.reshape(-1)), async_op)
    return all_gather_packed(
        output, to_bytes(quantize_blocks(input, bits, block_size)), input.numel(), group, async_op, bits, block_size
    )


def decode_packed(
    packed: torch.Tensor,
    output: torch.Tensor,
    numel: int,
    bits: int = WEIGHT_BITS,
    block_size: int = WEIGHT_BLOCK,
    symmetric: bool = True,
) -> None:
    """One rank's block-quantized `to_bytes` buffer of `numel` elements, dequantized into `output`."""
    dequantize_blocks_into(from_bytes(packed, numel, bits, block_size, symmetric), output)


def all_gather_packed(
    output: torch.Tensor,
    packed: torch.Tensor,
    numel: int,
    group=None,
    async_op: bool = False,
    bits: int = WEIGHT_BITS,
    block_size: int = WEIGHT_BLOCK,
    symmetric: bool = True,
):
    """`all_gather_into_tensor` of shards already block-quantized (`to_bytes` buffers of `numel`
    elements, equal on every rank): exchanged as they are, rank r's dequantized into slice r of `output`.
    qwZ quantizes before calling it; `zero_quantized_nontrainable_weights` stores its shards so."""
    world = get_world_size(group)
    if world == 1:
        return _done(lambda: decode_packed(packed, output, numel, bits, block_size, symmetric), async_op)
    recv = torch.empty(world * packed.numel(), dtype=torch.uint8, device=packed.device)
    _check_tensors("all_gather_packed", group, output, packed)

    def finish():
        rows, out = recv.view(world, -1), output.view(world, numel)
        for r in range(world):
            dequantize_blocks_into(from_bytes(rows[r], numel, bits, block_size, symmetric), out[r])

    return _launch(
        f"all_gather_int{bits}",
        recv.numel(),
        (world - 1) * packed.numel(),
        group,
        lambda a: _gather_bytes(recv, packed, group, a),
        finish,
        async_op,
    )


# -- hpZ ---------------------------------------------------------------------------------------------
def all_gather_secondary(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`all_gather_into_tensor` over an hpZ sub-group, counted as `all_gather_hpz`."""
    world = get_world_size(group)
    if world == 1:
        return _done(lambda: output.view(-1).copy_(input.reshape(-1)), async_op)
    _check_tensors("all_gather_secondary", group, output, input)
    return _launch(
        "all_gather_hpz",
        output.nbytes,
        output.nbytes * (world - 1) / world,
        group,
        lambda a: _gather_bytes(output, input.reshape(-1), group, a),
        lambda: None,
        async_op,
    )


def hpz_groups(group, size: int):
    """(intra, inter) `AxisGroup`s of this rank for hpZ sub-groups of `size` ranks of `group`
    (Note [hpZ sub-groups]); collective over the world."""
    members = [backend.global_rank(group, i) for i in range(get_world_size(group))]
    everyone = sorted({tuple(m) for m in backend.all_gather_object(members)})
    problems = [g for g in everyone if len(g) % size]
    if problems:
        raise ValueError(
            f"zero_hpz_partition_size={size} does not divide the data-parallel group size "
            f"{len(problems[0])}: choose a divisor of it (the ranks per node, usually)"
        )
    intra = [list(g[i : i + size]) for g in everyone for i in range(0, len(g), size)]
    inter = [list(g[j::size]) for g in everyone for j in range(size)]
    maker = GroupMaker(backend.get_rank(), backend.get_world_size())
    return maker.axis(intra), maker.axis(inter)


# -- qgZ ---------------------------------------------------------------------------------------------
def _quantized_rows(rows: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """Each row of [R, c] quantized on its own (a receiver decodes its rows alone): [R, bytes]."""
    return torch.stack([to_bytes(quantize_blocks(row, bits, block_size)) for row in rows])


def _decoded_sum(
    recv: torch.Tensor, c: int, bits: int, block_size: int, exact_row: torch.Tensor | None, own: int
) -> torch.Tensor:
    """Sum of the dequantized rows of `recv`, row `own` replaced by `exact_row` (this rank's own,
    never sent)."""
    total = exact_row.float().clone() if exact_row is not None else torch.zeros(c, device=recv.device)
    for r in range(recv.shape[0]):
        if r != own or exact_row is None:
            total += dequantize_blocks(from_bytes(recv[r], c, bits, block_size))
    return total


def _all_to_all_rows(
    kind: str, send: torch.Tensor, group, async_op: bool, finish_with, finish_communicates: bool = False
):
    recv = torch.empty_like(send)
    world = send.shape[0]
    return _launch(
        kind,
        send.numel(),
        (world - 1) * send.shape[1],
        group,
        lambda a: dist.all_to_all_single(recv, send, group=group, async_op=a),
        lambda: finish_with(recv),
        async_op,
        finish_communicates,
    )


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    bits: int = GRAD_BITS,
    block_size: int = GRAD_BLOCK,
    hierarchy=None,
):
    """`reduce_scatter_tensor(op="sum")` as an all-to-all of block-quantized chunks: chunk j of
    `input` (rank-major, N equal chunks) is quantized and sent to rank j, which dequantizes what it
    receives and sums it with its own chunk (kept exact). `hierarchy`, an (intra, inter) pair of
    `AxisGroup`s from `hpz_groups`, makes it two all-to-alls: within the sub-group first (partial
    sums of the chunks of the same block position), then across sub-groups, re-quantized."""
    world = get_world_size(group)
    c = output.numel()
    if world == 1:
        return _done(lambda: output.view(-1).copy_(input.reshape(-1)), async_op)
    rows = input.reshape(world, c)
    _check_tensors("reduce_scatter_quantized", group, output, input)
    if hierarchy is not None and 1 < hierarchy[0].size < world:
        return _two_level(output, rows, hierarchy, bits, block_size, async_op)
    me = get_rank(group)

    def finish(recv):
        output.view(-1).copy_(_decoded_sum(recv, c, bits, block_size, rows[me], me))

    return _all_to_all_rows("reduce_scatter_int4", _quantized_rows(rows, bits, block_size), group, async_op, finish)


def _two_level(output, rows_NC, hierarchy, bits, block_size, async_op):
    """Note [hierarchical qgZ]: N = M x H ranks in M blocks of H; group rank r = m H + l. Step 1,
    within a block: block member l' receives, from each of the H members, the chunks of the M ranks
    at position l' (r = m H + l'), and sums those H contributions. Step 2, across blocks (the ranks
    at one position): each partial sum goes to its owner, which sums the M of them. Per rank, step 1
    sends (H - 1) M chunks inside the block and step 2 sends M - 1 chunks across blocks, where the
    single-level all-to-all sends N - H chunks across blocks. Step 2 re-quantizes the partial sums."""
    intra, inter = hierarchy
    H, M, c = intra.size, inter.size, output.numel()
    by_position = rows_NC.view(M, H, c).transpose(0, 1)  # [H (destination position), M (block), c]
    send = _quantized_rows(by_position.reshape(H * M, c), bits, block_size).view(H, -1)
    local = by_position[intra.rank]  # [M, c]: my own contribution to my position's chunks, exact
    n_bytes = send.shape[1] // M

    def finish_intra(recv):
        pieces = recv.view(H, M, n_bytes)
        partial = torch.stack(
            [_decoded_sum(pieces[:, m], c, bits, block_size, local[m], intra.rank) for m in range(M)]
        )  # [M, c]: my block's sums for position intra.rank
        mine = partial[inter.rank]

        def finish_inter(recv2):
            output.view(-1).copy_(_decoded_sum(recv2, c, bits, block_size, mine, inter.rank).to(output.dtype))

        _all_to_all_rows(
            "reduce_scatter_int4_inter", _quantized_rows(partial, bits, block_size), inter.handle, False, finish_inter
        )

    return _all_to_all_rows(
        "reduce_scatter_int4_intra", send, intra.handle, async_op, finish_intra, finish_communicates=True
    )


def quantized_gather_bytes(chunk: int, world: int, bits: int = WEIGHT_BITS, block_size: int = WEIGHT_BLOCK) -> int:
    """Payload of `all_gather_quantized` for shards of `chunk` elements over `world` ranks."""
    return world * wire_bytes(chunk, bits, block_size)


def quantized_scatter_bytes(chunk: int, world: int, bits: int = GRAD_BITS, block_size: int = GRAD_BLOCK) -> int:
    """Payload of single-level `reduce_scatter_quantized` for output chunks of `chunk` elements."""
    return world * wire_bytes(chunk, bits, block_size)
