"""Evoformer attention (DeepSpeed4Science's `DS4Sci_EvoformerAttention`), memory-efficient, in pure PyTorch.

The attention of AlphaFold / OpenFold's Evoformer: for q, k, v of shape ``[B, N, L, H, D]`` (batch, MSA
rows or residues, sequence, heads, head dim) and up to two additive biases,

    O[b, n, :, h, :] = softmax(Q K^T / sqrt(D) + bias1 + bias2) V

with ``bias1`` ``[B, N, 1, 1, L]`` (a key mask, ``1e9 * (mask - 1)``, which is ``-inf`` in fp16) and
``bias2`` ``[B, 1, H, L, L]`` (the pair bias, shared by the N rows). Logits, softmax and gradients are
computed in fp32 (fp64 for fp64 inputs); the output has the input's dtype.

Note [evoformer chunks]: the naive form materialises the logits and the probabilities, ``[B, N, H, L, L]``
each, and autograd keeps them for backward: at N = L = 1024 that is 4 GiB per head in fp32. Here the
queries are processed in chunks (and the keys too, when one query row over all keys is itself too big),
with an online softmax across key chunks (running row maximum, rescaled running sum and output, as in
FlashAttention). The autograd function saves only q, k, v, the biases, the output and one log-sum-exp per
query row (O(L) per row, never O(L^2)); backward recomputes each block's probabilities from the log-sum-exp
and accumulates dQ, dK, dV and the bias gradients in fp32, each bias gradient reduced to the bias's own
shape block by block (dBias2 summed over N, dBias1 over heads and queries). The block size is chosen from
the shapes (`plan_chunks`: at most `DEFAULT_BLOCK_ELEMENTS` fp32 logits per block) or given.

Note [fully masked rows]: DeepSpeed's CUTLASS kernel keeps a running row maximum that starts at ``-inf``
and rescales by ``exp(m_prime - mi)`` with no guard (csrc/deepspeed4science/evoformer_attn/kernel_forward.h,
``iterative_softmax``): a row whose every logit is ``-inf`` (all keys masked with fp16's ``-inf``) computes
``exp(-inf - (-inf))`` = NaN and returns a NaN output row (and a NaN log-sum-exp, so NaN gradients), which
is also what ``torch.softmax`` over the materialised logits gives. This module does the same: such a row
is NaN in the output, and its NaN probabilities reach the gradients as in the naive reference. Unlike the
kernel, a partially masked row is exact whatever key block its unmasked keys fall in (the kernel's guardless
rescale also turns a row NaN when its first key block of 64 is entirely ``-inf``). With the finite mask of
bf16 / fp32 (``-1e9``) a fully masked row is a softmax over equal logits: the mean of the values, in both.

Note [evoformer fused path]: on CUDA, `backend="auto"` uses
``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention / memory-efficient kernels, O(L) saved
state as well) when that is exact and copies nothing: at most one bias, the bias needs no gradient, has the
input's dtype, and broadcasts without a copy over the flattened ``[B * N, H, L, L]`` batch (``bias1``
always; ``bias2`` when B = 1). Otherwise, and always on the CPU, the chunked path runs. Fully masked rows
are set to NaN after the kernel, so the forward agrees with the chunked path; the gradients of such rows
are whatever the kernel gives (its rows of zeros, where the chunked path and DeepSpeed propagate NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: Most fp32 logits one block of the chunked path holds ([B, N, H, q_chunk, k_chunk]): 4 MiB per temporary.
DEFAULT_BLOCK_ELEMENTS = 2**20
#: Fewest queries a block takes before the keys are chunked too (smaller blocks only add Python overhead).
MIN_QUERY_CHUNK = 16
BACKENDS = ("auto", "chunked", "sdpa")


class Chunks(NamedTuple):
    """Block sizes of the chunked path: queries per block and keys per block."""

    queries: int
    keys: int


def plan_chunks(rows: int, q_len: int, k_len: int, budget: int = DEFAULT_BLOCK_ELEMENTS) -> Chunks:
    """Block sizes holding at most `budget` logits for `rows` = B * N * H independent attention rows.

    Whole key rows when `MIN_QUERY_CHUNK` queries of them fit (no online rescaling needed), as many
    queries as fit; otherwise `MIN_QUERY_CHUNK` (or fewer) queries and as many keys as fit.
    """
    if min(rows, q_len, k_len, budget) < 1:
        raise ValueError(f"plan_chunks: rows {rows}, lengths {q_len}/{k_len} and budget {budget} must be >= 1")
    per_query = rows * k_len
    if per_query * min(MIN_QUERY_CHUNK, q_len) <= budget:
        return Chunks(min(q_len, budget // per_query), k_len)
    queries = min(MIN_QUERY_CHUNK, q_len)
    return Chunks(queries, max(1, min(k_len, budget // (rows * queries))))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bias_block(bias: torch.Tensor | None, q: slice, k: slice) -> torch.Tensor | None:
    """The part of a bias (broadcastable to [B, N, H, Lq, Lk]) that a block of queries `q` and keys `k` reads."""
    if bias is None:
        return None
    return bias[..., q if bias.shape[3] > 1 else slice(None), k if bias.shape[4] > 1 else slice(None)]


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a block's [B, N, H, q, k] gradient over the dims a bias block of `shape` broadcasts."""
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


def _logits(
    q_BNHqD: torch.Tensor, k_BNHkD: torch.Tensor, scale: float, b1: torch.Tensor | None, b2: torch.Tensor | None
) -> torch.Tensor:
    s = torch.matmul(q_BNHqD, k_BNHkD.transpose(-1, -2)).mul_(scale)
    for b in (b1, b2):
        if b is not None:
            s.add_(b)  # in the compute dtype: an fp16 -inf stays -inf, a finite bias is widened exactly
    return s


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, L, H, D] -> contiguous [B, N, H, L, D] in `dtype` (one copy)."""
    return x.transpose(2, 3).to(dtype).contiguous()


def _chunked_forward(q, k, v, bias1, bias2, chunks: Chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, N, Lq, H, Dv] in q's dtype, log-sum-exp [B, N, H, Lq] in the compute dtype)."""
    B, N, Lq, H, D = q.shape
    Lk, Dv = k.shape[2], v.shape[-1]
    ct = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(D)
    k_h, v_h = _heads_first(k, ct), _heads_first(v, ct)
    out = q.new_empty(B, N, Lq, H, Dv)
    lse = torch.empty(B, N, H, Lq, dtype=ct, device=q.device)
    for i0 in range(0, Lq, chunks.queries):
        qs = slice(i0, min(i0 + chunks.queries, Lq))
        q_i = q[:, :, qs].transpose(2, 3).to(ct)
        # online softmax over key blocks (Note [evoformer chunks]); m_safe keeps exp() finite while a
        # row has seen only -inf logits, so that only a row that is -inf to the end becomes NaN
        m = l = acc = None
        for j0 in range(0, Lk, chunks.keys):
            ks = slice(j0, min(j0 + chunks.keys, Lk))
            s = _logits(q_i, k_h[:, :, :, ks], scale, _bias_block(bias1, qs, ks), _bias_block(bias2, qs, ks))
            m_new = s.amax(-1, keepdim=True) if m is None else torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            p = s.sub_(m_safe).exp_()
            if m is None:
                l, acc = p.sum(-1, keepdim=True), torch.matmul(p, v_h[:, :, :, ks])
            else:
                alpha = (m - m_safe).exp_()
                l = l.mul_(alpha).add_(p.sum(-1, keepdim=True))
                acc = acc.mul_(alpha).add_(torch.matmul(p, v_h[:, :, :, ks]))
            m = m_new
        # a fully masked row: l = 0 and acc = 0, so 0 / 0 = NaN and lse = -inf (Note [fully masked rows])
        out[:, :, qs] = acc.div_(l).transpose(2, 3).to(q.dtype)
        lse[:, :, :, qs] = (m.masked_fill(m == -math.inf, 0.0) + l.log()).squeeze(-1)
    return out, lse


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """out += alpha * a @ b (batched). In place when `out` is contiguous (whole key rows: a `+=` would allocate
    an increment as large as dK itself, 80.6 -> 77.0 MiB of peak at L = 1024); through a block-sized product
    otherwise, where baddbmm_ into a strided slice is 2-6x slower on the CPU than bmm and an add."""
    if out.is_contiguous():
        out.baddbmm_(a, b, alpha=alpha)
    else:
        out.add_(torch.bmm(a, b), alpha=alpha)


def _chunked_backward(grad_out, q, k, v, out, lse, bias1, bias2, chunks: Chunks, need_b1: bool, need_b2: bool):
    """(dQ, dK, dV, dBias1, dBias2): recomputed block by block from the log-sum-exp, accumulated in fp32."""
    B, N, Lq, H, D = q.shape
    Lk = k.shape[2]
    ct = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(D)
    k_h, v_h = _heads_first(k, ct), _heads_first(v, ct)
    # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax backward's row term, O(L) per row
    delta = (grad_out.to(ct) * out.to(ct)).sum(-1).transpose(2, 3)  # [B, N, H, Lq]
    dq = torch.zeros(B, N, H, Lq, D, dtype=ct, device=q.device)
    dk, dv = torch.zeros_like(k_h), torch.zeros_like(v_h)
    db1 = torch.zeros(bias1.shape, dtype=ct, device=q.device) if need_b1 else None
    db2 = torch.zeros(bias2.shape, dtype=ct, device=q.device) if need_b2 else None
    # dQ, dK, dV accumulate over the flattened B * N * H batch (`_accumulate`)
    bnh = B * N * H
    k3, v3, dq3, dk3, dv3 = (t.view(bnh, t.shape[3], t.shape[4]) for t in (k_h, v_h, dq, dk, dv))
    for i0 in range(0, Lq, chunks.queries):
        qs = slice(i0, min(i0 + chunks.queries, Lq))
        q_i = q[:, :, qs].transpose(2, 3).to(ct)
        do_i = grad_out[:, :, qs].transpose(2, 3).to(ct)
        q_i3, do_i3 = q_i.reshape(bnh, -1, D), do_i.reshape(bnh, -1, do_i.shape[-1])
        lse_i, delta_i = lse[:, :, :, qs, None], delta[:, :, :, qs, None]
        for j0 in range(0, Lk, chunks.keys):
            ks = slice(j0, min(j0 + chunks.keys, Lk))
            s = _logits(q_i, k_h[:, :, :, ks], scale, _bias_block(bias1, qs, ks), _bias_block(bias2, qs, ks))
            p = s.sub_(lse_i).exp_()
            _accumulate(dv3[:, ks], p.view(bnh, *p.shape[3:]).transpose(1, 2), do_i3)
            ds = torch.matmul(do_i, v_h[:, :, :, ks].transpose(-1, -2)).sub_(delta_i).mul_(p)  # dLogits
            if db1 is not None:
                blk = _bias_block(db1, qs, ks)
                blk += _reduce_to(ds, blk.shape)
            if db2 is not None:
                blk = _bias_block(db2, qs, ks)
                blk += _reduce_to(ds, blk.shape)
            ds3 = ds.view(bnh, *ds.shape[3:])
            _accumulate(dq3[:, qs], ds3, k3[:, ks], alpha=scale)
            _accumulate(dk3[:, ks], ds3.transpose(1, 2), q_i3, alpha=scale)
    grads = [dq.transpose(2, 3).to(q.dtype), dk.transpose(2, 3).to(k.dtype), dv.transpose(2, 3).to(v.dtype)]
    return (*grads, None if db1 is None else db1.to(bias1.dtype), None if db2 is None else db2.to(bias2.dtype))


class EvoformerFusedAttention(torch.autograd.Function):
    """DeepSpeed's autograd function: ``EvoformerFusedAttention.apply(q, k, v, bias1=None, bias2=None)``.

    q, k, v ``[B, N, L, H, D]``; each bias None or broadcastable to the logits ``[B, N, H, L, L]``
    (``bias1`` ``[B, N, 1, 1, L]``, ``bias2`` ``[B, 1, H, L, L]``). Always the chunked path (Note [evoformer
    chunks]); a sixth argument, `Chunks`, overrides the block sizes.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias1=None, bias2=None, chunks: Chunks | None = None):
        _check_qkv(q, k, v)
        for name, b in (("bias1", bias1), ("bias2", bias2)):
            _check_broadcast(name, b, q, k)
        B, N, Lq, H, _ = q.shape
        chunks = chunks or plan_chunks(B * N * H, Lq, k.shape[2])
        out, lse = _chunked_forward(q, k, v, bias1, bias2, chunks)
        ctx.save_for_backward(q, k, v, out, lse, bias1, bias2)
        ctx.chunks = chunks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, bias1, bias2 = ctx.saved_tensors
        need_b1 = bias1 is not None and ctx.needs_input_grad[3]
        need_b2 = bias2 is not None and ctx.needs_input_grad[4]
        grads = _chunked_backward(grad_out, q, k, v, out, lse, bias1, bias2, ctx.chunks, need_b1, need_b2)
        return (*grads, None)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 5:
        raise ValueError(
            f"Q must be 5-D [B, N, L, H, D] (batch, rows, sequence, heads, head dim), got {tuple(q.shape)}"
        )
    B, N, L, H, D = q.shape
    if k.dim() != 5 or tuple(k.shape[:2]) != (B, N) or k.shape[3] != H or k.shape[4] != D:
        raise ValueError(f"K must be [B, N, L_k, H, D] = [{B}, {N}, L_k, {H}, {D}] like Q, got {tuple(k.shape)}")
    if v.dim() != 5 or tuple(v.shape[:4]) != tuple(k.shape[:4]):
        raise ValueError(
            f"V must be [{B}, {N}, {k.shape[2]}, {H}, D_v] like K but for its last dim, got {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"Q, K, V must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_broadcast(name: str, bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    if bias is None:
        return
    B, N, Lq, H, _ = q.shape
    full = (B, N, H, Lq, k.shape[2])
    if bias.dim() != 5 or any(b not in (1, f) for b, f in zip(bias.shape, full)):
        raise ValueError(f"{name} must broadcast to the logits [B, N, H, L, L] = {list(full)}, got {tuple(bias.shape)}")


def _sdpa_mask(q: torch.Tensor, bias1, bias2) -> tuple[bool, torch.Tensor | None]:
    """(whether the fused path is exact and copy-free, its attn_mask over [B * N, H, Lq, Lk])."""
    B, N, Lq, H, _ = q.shape
    given = [b for b in (bias1, bias2) if b is not None]
    if not given:
        return True, None
    if len(given) == 2 or given[0].requires_grad or given[0].dtype != q.dtype:
        return False, None
    if bias1 is not None:
        return True, bias1.reshape(B * N, 1, 1, -1)
    if B == 1:
        return True, bias2.reshape(1, H, Lq, -1)
    return False, None


def _sdpa_attention(q, k, v, mask):
    B, N, Lq, H, D = q.shape
    flat = lambda x: x.reshape(B * N, x.shape[2], H, x.shape[4]).transpose(1, 2)  # noqa: E731
    o = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=mask, scale=1.0 / math.sqrt(D))
    if mask is not None:  # Note [fully masked rows]: NaN, as the chunked path and DeepSpeed's kernel give
        dead = (mask == -math.inf).all(-1, keepdim=True)
        o = o.masked_fill(dead, math.nan)
    return o.transpose(1, 2).reshape(B, N, Lq, H, v.shape[-1])


def evoformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias1: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    *,
    chunks: Chunks | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D) + bias1 + bias2) v`` over [B, N, L, H, D] inputs, without the [B, N, H, L, L]
    logits. `chunks` fixes the chunked path's block sizes (default `plan_chunks`); `backend` is "auto" (the
    fused SDPA path on CUDA where exact, Note [evoformer fused path]), "chunked" or "sdpa" (forced: an error
    where it is not exact)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_qkv(q, k, v)
    for name, b in (("bias1", bias1), ("bias2", bias2)):
        _check_broadcast(name, b, q, k)
    if backend != "chunked" and (backend == "sdpa" or q.is_cuda):
        exact, mask = _sdpa_mask(q, bias1, bias2)
        if exact:
            return _sdpa_attention(q, k, v, mask)
        if backend == "sdpa":
            raise ValueError(
                "backend='sdpa' is exact only for at most one bias that needs no gradient, in Q's dtype "
                "(bias2 only with B = 1): use backend='chunked' or 'auto'"
            )
    return EvoformerFusedAttention.apply(q, k, v, bias1, bias2, chunks)


def DS4Sci_EvoformerAttention(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    biases: Sequence[torch.Tensor | None],
    *,
    chunks: Chunks | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """DeepSpeed's entry point: Q, K, V ``[B, N, L, H, D]``, `biases` a list of at most two, ``[bias1]`` or
    ``[bias1, bias2]`` (either may be None): ``bias1`` ``[B, N, 1, 1, L]``, ``bias2`` ``[B, 1, H, L, L]``.
    Returns ``[B, N, L, H, D]`` in Q's dtype. Unlike DeepSpeed's kernel: any dtype (fp32 too), any L and D,
    CPU and CUDA; the `biases` list is not modified. `chunks` and `backend` as in `evoformer_attention`."""
    if len(biases) > 2:
        raise ValueError(f"biases holds at most two tensors ([bias1, bias2]), got {len(biases)}")
    _check_qkv(Q, K, V)
    bias1, bias2 = (list(biases) + [None, None])[:2]
    B, N, L, H, _ = Q.shape
    for name, bias, shape in (("bias1", bias1, (B, N, 1, 1, L)), ("bias2", bias2, (B, 1, H, L, L))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(
                f"{name} must have shape {list(shape)} for Q of shape {list(Q.shape)}, got {list(bias.shape)}"
            )
    return evoformer_attention(Q, K, V, bias1, bias2, chunks=chunks, backend=backend)
