"""Block-sparse attention kernels in pure PyTorch: the gather path and the flex_attention path.

Both compute, for every head ``h`` and query block ``i``, softmax over the keys of the active blocks
``j`` (``layout[h, i, j] == 1``) of ``scale * q k^T + rpe + key_padding_mask + attn_mask`` and the
weighted sum of the values: exactly dense attention with the layout expanded to a token mask, and
DeepSpeed's order of terms (scale first, then the additive terms).

Note [gather path]: block rows (one per head and query block) with the same set of active key
blocks form a group (in Fixed's bidirectional pattern, the rows of one local window); groups are
sorted by size and length and cut into chunks (a group too big for one is split by rows), each
padded to its longest row. A chunk gathers the query blocks of its groups ``[B, g, m*block, D]``
and each group's active key and value blocks ``[B, g, n*block, D]`` once (``index_select``),
computes the scores ``[B, g, m*block, n*block]`` (padding masked) and takes an ordinary softmax:
every row is whole in its chunk. The autograd function keeps only q, k, v, the output and one
log-sum-exp per query; backward recomputes each chunk's probabilities from them (FlashAttention's
recomputation, per group of block rows). Memory is therefore O(B·H·L·D) plus one chunk, whatever
the pattern, and no ``[L, L]`` tensor exists unless the caller passes one (a dense ``attn_mask`` or
``rpe``, of which only the active blocks are read). Compute is proportional to the number of
active blocks.

Note [flex path]: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built straight from the
layout (no ``[L, L]`` mask is evaluated). In torch 2.13 flex_attention has no backward on CPU and
its CPU forward is fast only compiled (tens of seconds per new shape), so ``kernel="auto"`` picks it
on CUDA only; on CPU it is available for inference with ``kernel="flex"``.

Rows with no attendable key (an empty layout row, or every key masked with ``-inf``) give a zero
output and zero gradients, where DeepSpeed's Triton softmax gives NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch

#: Elements of B x chunk_blocks x block x (block + head_dim) per gather chunk (~8 MiB per fp32 temporary).
DEFAULT_CHUNK_ELEMENTS = 2**21
#: flex_attention's native tile; layouts with smaller blocks are coarsened to it when they divide it.
FLEX_TILE = 128
MASK_MODES = ("add", "mul")
KERNELS = ("auto", "gather", "flex")


class Chunk(NamedTuple):
    """Groups of block rows; the rows of a group share their active key blocks, padded to the chunk's
    longest row.

    ``rows``/``q_blocks`` are ``[g, m]`` (flat query row ``h*nb + i`` and block ``i``), ``heads`` is
    ``[g]``; ``kv_rows``/``kv_blocks`` are ``[g, n]`` (flat key row ``h*nb + j`` and block ``j``;
    padding points at block 0 of the head); ``pad`` is ``[g, n]`` True on padding, or None.
    """

    rows: torch.Tensor
    heads: torch.Tensor
    q_blocks: torch.Tensor
    kv_rows: torch.Tensor
    kv_blocks: torch.Tensor
    pad: torch.Tensor | None


class BlockSparsePlan:
    """The index tables of one ``[heads, blocks, blocks]`` layout, on one device.

    Built once per layout (``SparseSelfAttention`` keeps one per sequence length); the chunks for a
    given chunk size are cut on first use and cached.
    """

    def __init__(self, layout: torch.Tensor, block: int, device: torch.device | str | None = None):
        if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
            raise ValueError(f"layout must be [heads, blocks, blocks], got shape {tuple(layout.shape)}")
        self.block = block
        self.num_heads, self.num_blocks = layout.shape[0], layout.shape[1]
        self.layout = (layout != 0).to(device or layout.device)
        # Row-major, so the key blocks of one (head, query block) row are consecutive entries.
        self.kv_blocks = self.layout.nonzero()[:, 2]
        self.row_counts = self.layout.sum(-1).flatten()  # active blocks per (head, query block)
        self.row_starts = torch.cumsum(self.row_counts, 0) - self.row_counts
        self._chunks: dict[int, list[Chunk]] = {}

    @property
    def num_active(self) -> int:
        """Active (head, query block, key block) triples."""
        return int(self.kv_blocks.numel())

    @property
    def density(self) -> float:
        """Fraction of the blocks that are active."""
        return self.num_active / max(1, self.num_heads * self.num_blocks**2)

    def groups(self) -> list[torch.Tensor]:
        """The non-empty rows (flat ``h*nb + i``) grouped by head and identical set of key blocks.

        Rows are compared as bit-packed masks (nb/8 bytes each), one head at a time."""
        nb = self.num_blocks
        bits = torch.nn.functional.pad(self.layout, (0, -nb % 8)).view(self.num_heads, nb, -1, 8)
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
        groups = []
        for head in range(self.num_heads):
            rows = torch.nonzero(self.row_counts[head * nb : (head + 1) * nb] > 0).flatten()
            if rows.numel() == 0:
                continue
            packed = (bits[head, rows].to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)
            _, inverse = torch.unique(packed, dim=0, return_inverse=True)
            order = torch.argsort(inverse, stable=True)
            groups.extend((rows[order] + head * nb).split(torch.bincount(inverse).tolist()))
        return groups

    def chunks(self, max_blocks: int) -> list[Chunk]:
        """Groups sorted by (rows, length), cut so that a chunk's padded score and key blocks,
        groups x length x (rows + 1), stay within ``max_blocks`` (groups too big are split by rows;
        a chunk holds at least one row); a chunk's groups have the same number of rows."""
        if max_blocks not in self._chunks:
            groups = []
            for group in self.groups():  # a group too big for one chunk (dense rows) is split
                rows = max(1, max_blocks // int(self.row_counts[group[0]]) - 1)
                groups.extend(group.split(rows))
            shape = [(len(g), int(self.row_counts[g[0]])) for g in groups]
            order = sorted(range(len(groups)), key=lambda u: shape[u])
            chunks, current = [], []
            for u in order:
                rows, length = shape[u]
                if current and (shape[current[0]][0] != rows or (len(current) + 1) * length * (rows + 1) > max_blocks):
                    chunks.append(self._chunk([groups[c] for c in current], shape[current[-1]][1]))
                    current = []
                current.append(u)
            if current:
                chunks.append(self._chunk([groups[c] for c in current], shape[current[-1]][1]))
            self._chunks[max_blocks] = chunks
        return self._chunks[max_blocks]

    def _chunk(self, groups: list[torch.Tensor], width: int) -> Chunk:
        rows = torch.stack(groups)  # [g, m]
        first = rows[:, 0]
        slots = torch.arange(width, device=rows.device)
        pad = slots[None, :] >= self.row_counts[first][:, None]
        entry = (self.row_starts[first][:, None] + slots[None, :]).masked_fill(pad, 0)
        kv_blocks = self.kv_blocks[entry].masked_fill(pad, 0)
        heads = torch.div(first, self.num_blocks, rounding_mode="floor")
        return Chunk(
            rows,
            heads,
            rows % self.num_blocks,
            heads[:, None] * self.num_blocks + kv_blocks,
            kv_blocks,
            pad if bool(pad.any()) else None,
        )


# --- masks and position terms, read block by block -------------------------------------------------


def _as_4d(mask: torch.Tensor, name: str, seq_len: int) -> torch.Tensor:
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dim() != 4 or mask.shape[-2:] != (seq_len, seq_len):
        raise ValueError(f"{name} must be [L, L] or [B|1, H|1, L, L] with L={seq_len}, got {tuple(mask.shape)}")
    return mask


def _mode_bias(values: torch.Tensor, mode: str) -> torch.Tensor:
    """An additive float32 term: 'add' adds the values, 'mul' turns zeros into -inf and the rest into 0."""
    if mode == "mul":
        return torch.zeros((), dtype=torch.float32, device=values.device).masked_fill(values == 0, -math.inf)
    return values.to(torch.float32)


class ScoreBias:
    """The additive terms of the scores, gathered for the active blocks of one chunk at a time."""

    def __init__(
        self,
        batch: int,
        heads: int,
        seq_len: int,
        block: int,
        *,
        key_padding_mask=None,
        key_padding_mask_mode: str = "add",
        attn_mask=None,
        attn_mask_mode: str = "add",
        rpe=None,
        causal: bool = False,
    ):
        for mode in (key_padding_mask_mode, attn_mask_mode):
            if mode not in MASK_MODES:
                raise ValueError(f"mask mode {mode!r}: expected 'add' or 'mul'")
        self.batch, self.heads, self.seq_len, self.block = batch, heads, seq_len, block
        self.key_padding = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, seq_len):
                raise ValueError(
                    f"key_padding_mask must be [B, L] = [{batch}, {seq_len}], got {tuple(key_padding_mask.shape)}"
                )
            bias = _mode_bias(key_padding_mask, key_padding_mask_mode)
            self.key_padding = bias.view(batch, seq_len // block, block)
        self.attn_mask = None if attn_mask is None else self._tiles(attn_mask, "attn_mask")
        self.attn_mask_mode = attn_mask_mode
        self.rpe = None if rpe is None else self._tiles(rpe, "rpe")
        self.causal = causal

    def _tiles(self, dense: torch.Tensor, name: str) -> torch.Tensor:
        """A view ``[B|1, H|1, nb, nb, block, block]`` of a dense ``[.., L, L]`` tensor (no copy)."""
        dense = _as_4d(dense.detach(), name, self.seq_len)
        if dense.shape[0] not in (1, self.batch) or dense.shape[1] not in (1, self.heads):
            raise ValueError(
                f"{name} of shape {tuple(dense.shape)} does not broadcast to [{self.batch}, {self.heads}, L, L]"
            )
        nb = self.seq_len // self.block
        return dense.unflatten(3, (nb, self.block)).unflatten(2, (nb, self.block)).permute(0, 1, 2, 4, 3, 5)

    def _gather(self, tiles: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        heads = chunk.heads if tiles.shape[1] > 1 else torch.zeros_like(chunk.heads)
        picked = tiles[:, heads[:, None, None], chunk.q_blocks[:, :, None], chunk.kv_blocks[:, None, :]]
        return picked.permute(0, 1, 2, 4, 3, 5)  # [B|1, g, m, block, n, block]

    def __call__(self, chunk: Chunk) -> torch.Tensor | None:
        """The term to add to the chunk's ``[B, g, m, block, n, block]`` scores, or None."""
        terms = []
        if self.rpe is not None:
            terms.append(self._gather(self.rpe, chunk).to(torch.float32))
        if self.key_padding is not None:
            terms.append(self.key_padding[:, chunk.kv_blocks][:, :, None, None])  # [B, g, 1, 1, n, block]
        if self.attn_mask is not None:
            terms.append(_mode_bias(self._gather(self.attn_mask, chunk), self.attn_mask_mode))
        if self.causal:
            terms.append(self._causal(chunk))
        if chunk.pad is not None:
            terms.append(_mode_bias(~chunk.pad[:, None, None, :, None], "mul"))  # [g, 1, 1, n, 1]
        if not terms:
            return None
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    def _causal(self, chunk: Chunk) -> torch.Tensor:
        offsets = torch.arange(self.block, device=chunk.q_blocks.device)
        blocks_ahead = (chunk.kv_blocks[:, None, :] - chunk.q_blocks[:, :, None]) * self.block  # [g, m, n]
        key_minus_query = blocks_ahead[:, :, None, :, None] + offsets - offsets[:, None, None]
        return _mode_bias(key_minus_query <= 0, "mul")  # [g, m, block, n, block]


# --- the gather path ---------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: float32, or the input's dtype when wider."""
    return torch.promote_types(dtype, torch.float32)


def _gather_rows(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, R, block, D]`` rows picked by a ``[g, k]`` index, as ``[B, g, k*block, D]``."""
    batch, _, block, dim = blocks.shape
    return blocks.index_select(1, index.flatten()).view(batch, index.shape[0], index.shape[1] * block, dim)


def _scatter_view(values: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, g, k*block, D]`` back to ``[B, g*k, block, D]``, for index_add_ / index_copy_."""
    return values.reshape(values.shape[0], -1, block, values.shape[-1])


def _scores(q_blk, k_blk, chunk: Chunk, scale: float, bias: ScoreBias):
    """The chunk's scores ``[B, g, m*block, n*block]`` and its gathered q and k."""
    q_g, k_g = _gather_rows(q_blk, chunk.rows), _gather_rows(k_blk, chunk.kv_rows)
    scores = torch.matmul(q_g, k_g.transpose(-1, -2)).to(_acc_dtype(q_blk.dtype)) * scale
    term = bias(chunk)
    if term is not None:
        (groups, rows), width, block = chunk.rows.shape, chunk.kv_rows.shape[1], bias.block
        tiled = scores.view(scores.shape[0], groups, rows, block, width, block) + term.to(scores.dtype)
        scores = tiled.view(scores.shape)
    return scores, q_g, k_g


def _row_stat(stat: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """A per-query ``[B, R, block]`` statistic for the chunk's queries, as ``[B, g, m*block, 1]``."""
    return stat.index_select(1, chunk.rows.flatten()).view(stat.shape[0], chunk.rows.shape[0], -1, 1)


class _GatherAttention(torch.autograd.Function):
    """Note [gather path]: chunked forward, recomputing backward; masks and rpe get no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, chunks, scale, bias):
        batch, heads, seq_len, dim = q.shape
        shape = (batch, heads * (seq_len // bias.block), bias.block, dim)
        q_blk, k_blk, v_blk = q.view(shape), k.view(shape), v.view(shape)
        out = torch.zeros(shape, dtype=q.dtype, device=q.device)
        # +inf marks rows with nothing to attend (empty rows, all keys -inf): exp(s - lse) is 0 there.
        lse = torch.full(shape[:3], math.inf, dtype=_acc_dtype(q.dtype), device=q.device)
        for chunk in chunks:
            scores, _, _ = _scores(q_blk, k_blk, chunk, scale, bias)
            row_lse = torch.logsumexp(scores, -1, keepdim=True)
            row_lse = row_lse.masked_fill(torch.isneginf(row_lse), math.inf)
            values = torch.matmul(torch.exp(scores - row_lse).to(v.dtype), _gather_rows(v_blk, chunk.kv_rows))
            rows = chunk.rows.flatten()
            out.index_copy_(1, rows, _scatter_view(values.to(q.dtype), bias.block))
            lse.index_copy_(1, rows, row_lse.view(batch, -1, bias.block))
        out = out.view(q.shape)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale, ctx.bias = chunks, scale, bias
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        block = ctx.bias.block
        shape = (q.shape[0], lse.shape[1], block, q.shape[-1])
        q_blk, k_blk, v_blk = q.view(shape), k.view(shape), v.view(shape)
        do_blk = grad_out.contiguous().view(shape)
        acc = _acc_dtype(q.dtype)
        delta = (do_blk.to(acc) * out.view(shape).to(acc)).sum(-1)
        dq, dk, dv = (torch.zeros(shape, dtype=acc, device=q.device) for _ in range(3))
        for chunk in ctx.chunks:
            scores, q_g, k_g = _scores(q_blk, k_blk, chunk, ctx.scale, ctx.bias)
            probs = torch.exp(scores - _row_stat(lse, chunk))
            do_g = _gather_rows(do_blk, chunk.rows)
            keys = chunk.kv_rows.flatten()
            d_v = torch.matmul(probs.to(q.dtype).transpose(-1, -2), do_g)
            dv.index_add_(1, keys, _scatter_view(d_v.to(acc), block))
            d_probs = torch.matmul(do_g, _gather_rows(v_blk, chunk.kv_rows).transpose(-1, -2)).to(acc)
            d_scores = (probs * (d_probs - _row_stat(delta, chunk)) * ctx.scale).to(q.dtype)
            dq.index_copy_(1, chunk.rows.flatten(), _scatter_view(torch.matmul(d_scores, k_g).to(acc), block))
            d_k = torch.matmul(d_scores.transpose(-1, -2), q_g)
            dk.index_add_(1, keys, _scatter_view(d_k.to(acc), block))
        return (*(g.to(q.dtype).view(q.shape) for g in (dq, dk, dv)), None, None, None)


def _chunk_blocks(batch: int, block: int, dim: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // (batch * block * (block + dim)))


# --- the flex_attention path -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(plan: BlockSparsePlan, causal: bool = False):
    """A flex_attention ``BlockMask`` from the layout: tiles of ``FLEX_TILE`` tokens when the block
    divides it and the sequence is a multiple of it (partly active tiles are refined by a mask_mod
    reading the layout), else tiles of one block. Costs O(blocks^2), never O(L^2)."""
    from torch.nn.attention.flex_attention import BlockMask

    layout, block, nb = plan.layout, plan.block, plan.num_blocks
    ratio = FLEX_TILE // block if FLEX_TILE % block == 0 and (nb * block) % FLEX_TILE == 0 else 1
    tiles = nb // ratio
    active = layout.view(plan.num_heads, tiles, ratio, tiles, ratio).sum((2, 4))
    full = active == ratio * ratio
    if causal:
        full &= torch.ones(tiles, tiles, dtype=torch.bool, device=layout.device).tril(-1)
    partial = (active > 0) & ~full

    def as_kv(blocks: torch.Tensor):
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # active tiles first
        return blocks.sum(-1).to(torch.int32)[None], order.to(torch.int32)[None]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = layout[h, q_idx // block, kv_idx // block]
        return keep & (kv_idx <= q_idx) if causal else keep

    num, idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=ratio * block, mask_mod=mask_mod, seq_lengths=(nb * block, nb * block)
    )


def _flex_score_mod(bias: ScoreBias):
    kp = None if bias.key_padding is None else bias.key_padding.flatten(1)
    attn = None if bias.attn_mask is None else _dense(bias.attn_mask, bias.attn_mask_mode)
    rpe = None if bias.rpe is None else _dense(bias.rpe, "add")
    if kp is None and attn is None and rpe is None:
        return None

    def pick(t, b, h, q_idx, kv_idx):
        return t[b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0, q_idx, kv_idx]

    def score_mod(score, b, h, q_idx, kv_idx):
        if rpe is not None:
            score = score + pick(rpe, b, h, q_idx, kv_idx)
        if kp is not None:
            score = score + kp[b, kv_idx]
        if attn is not None:
            score = score + pick(attn, b, h, q_idx, kv_idx)
        return score

    return score_mod


def _dense(tiles: torch.Tensor, mode: str) -> torch.Tensor:
    b, h, nb, _, block, _ = tiles.shape
    return _mode_bias(tiles.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nb * block, nb * block), mode)


def flex_block_sparse_attention(
    q, k, v, plan: BlockSparsePlan, scale: float, bias: ScoreBias, compiled: bool = True
) -> torch.Tensor:
    """Note [flex path]. ``compiled=False`` runs flex_attention's eager reference (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("flex_attention has no backward on CPU in this torch; use kernel='gather'")
    if not torch.is_grad_enabled():
        q, k, v = q.detach(), k.detach(), v.detach()  # flex refuses inputs that require grad on CPU
    fn = _compiled_flex() if compiled else flex_attention
    out = fn(q, k, v, score_mod=_flex_score_mod(bias), block_mask=flex_block_mask(plan, bias.causal), scale=scale)
    return out


# --- entry point ---------------------------------------------------------------------------------------


def _match_heads(layout: torch.Tensor, heads: int) -> torch.Tensor:
    if layout.shape[0] == heads:
        return layout
    if bool((layout == layout[:1]).all()):
        return layout[:1].expand(heads, -1, -1)
    raise ValueError(f"the layout has {layout.shape[0]} different head layouts but the input has {heads} heads")


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: torch.Tensor | None,
    block: int,
    *,
    scale: float | None = None,
    rpe: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask_mode: str = "add",
    attn_mask_mode: str = "add",
    causal: bool = False,
    plan: BlockSparsePlan | None = None,
    kernel: str = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Attention of ``query``/``key``/``value`` ``[B, H, L, D]`` restricted to the active blocks.

    ``layout`` is ``[H or 1 (shared), L/block, L/block]`` (or pass a ready ``plan``);
    ``key_padding_mask`` is ``[B, L]``; ``attn_mask`` and ``rpe`` are ``[L, L]`` or ``[B|1, H|1, L, L]``;
    mask modes as in DeepSpeed ('add': added, 'mul': zero means masked). ``scale`` defaults to
    ``D ** -0.5``; ``causal`` also masks later tokens inside the active blocks (zerospeed's addition).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if query.shape != key.shape or key.shape != value.shape or query.dim() != 4:
        raise NotImplementedError(
            f"only self-attention with q, k, v of one shape [B, H, L, D] is supported, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batch, heads, seq_len, dim = query.shape
    if seq_len % block != 0:
        raise ValueError(f"sequence length {seq_len} is not a multiple of the block size {block}")
    if plan is None:
        plan = BlockSparsePlan(_match_heads(layout, heads), block, query.device)
    if plan.num_heads != heads or plan.num_blocks * block != seq_len:
        raise ValueError(
            f"the plan is for {plan.num_heads} heads x {plan.num_blocks * block} tokens, "
            f"the input has {heads} x {seq_len}"
        )
    bias = ScoreBias(
        batch,
        heads,
        seq_len,
        block,
        key_padding_mask=key_padding_mask,
        key_padding_mask_mode=key_padding_mask_mode,
        attn_mask=attn_mask,
        attn_mask_mode=attn_mask_mode,
        rpe=rpe,
        causal=causal,
    )
    scale = dim**-0.5 if scale is None else float(scale)
    if kernel == "flex" or (kernel == "auto" and query.is_cuda):
        return flex_block_sparse_attention(query, key, value, plan, scale, bias)
    chunks = plan.chunks(_chunk_blocks(batch, block, dim, chunk_elements))
    return _GatherAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), chunks, scale, bias)


__all__ = [
    "BlockSparsePlan",
    "ScoreBias",
    "block_sparse_attention",
    "flex_block_mask",
    "flex_block_sparse_attention",
    "DEFAULT_CHUNK_ELEMENTS",
]
