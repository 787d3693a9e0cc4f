"""A small OpenFold-style Evoformer on DS4Sci_EvoformerAttention: the four attentions of DeepSpeed's tutorial.

An MSA representation ``m`` ``[B, S, R, c_m]`` (S aligned sequences, R residues) and a pair representation
``z`` ``[B, R, R, c_z]`` go through, per block (AlphaFold 2's Evoformer, Algorithm 6, without dropout,
outer product mean and triangle multiplication, so every line of attention is one of DeepSpeed's uses):

- MSA row attention with pair bias: attention along residues per sequence, Q, K, V ``[B, S, R, H, D]``,
  the residue mask as bias1 ``[B, S, 1, 1, R]``, a projection of ``z`` as bias2 ``[B, 1, H, R, R]``;
- MSA column attention: along sequences per residue, Q, K, V ``[B, R, S, H, D]``, bias1 only;
- MSA transition (a two-layer MLP);
- triangle attention around the starting node: along ``j`` for each ``i`` of ``z[i, j]``, bias1 the pair
  mask, bias2 a projection of ``z`` itself ``[B, 1, H, R, R]``;
- triangle attention around the ending node: the same on ``z`` transposed (along ``i`` for each ``j``);
- pair transition.

Each attention is gated (sigmoid of a projection of its input, as OpenFold does) and residual.
`attention="evoformer"` runs zerospeed's DS4Sci_EvoformerAttention, `"naive"` the materialised
softmax(q k^T / sqrt(D) + biases) v: the reference the parity test compares against. Deterministic (no
dropout), so two runs from one seed give the same losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.ops.deepspeed4science import DS4Sci_EvoformerAttention

__all__ = ["EvoformerConfig", "Evoformer", "naive_evoformer_attention", "evoformer_batch"]


@dataclass
class EvoformerConfig:
    c_m: int = 16  # MSA channels
    c_z: int = 8  # pair channels
    heads: int = 2
    head_dim: int = 8
    blocks: int = 2
    attention: str = "evoformer"  # or "naive"


def naive_evoformer_attention(q, k, v, biases):
    """The reference: [B, N, L, H, D] attention with the [B, N, H, L, L] logits materialised."""
    s = torch.einsum("bnqhd,bnkhd->bnhqk", q, k) / math.sqrt(q.shape[-1])
    for b in biases:
        if b is not None:
            s = s + b
    return torch.einsum("bnhqk,bnkhd->bnqhd", torch.softmax(s, -1), v)


class GatedAttention(nn.Module):
    """LayerNorm, Q/K/V projections to [B, N, L, H, D], the attention with up to two biases, a sigmoid gate
    and the output projection (OpenFold's `Attention` with `gating=True`)."""

    def __init__(self, c_in: int, heads: int, head_dim: int, attention: str) -> None:
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, head_dim, attention
        self.norm = nn.LayerNorm(c_in)
        self.qkv = nn.Linear(c_in, 3 * heads * head_dim, bias=False)
        self.gate = nn.Linear(c_in, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, c_in)

    def forward(self, x: torch.Tensor, bias1: torch.Tensor, bias2: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, N, L, c_in]; bias1 [B, N, 1, 1, L]; bias2 [B, 1, H, L, L] or None."""
        x = self.norm(x)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)
        biases = [bias1] if bias2 is None else [bias1, bias2]
        if self.attention == "evoformer":
            o = DS4Sci_EvoformerAttention(q, k, v, biases)
        else:
            o = naive_evoformer_attention(q, k, v, biases)
        return self.out(torch.sigmoid(self.gate(x)) * o.flatten(-2))


class Transition(nn.Module):
    def __init__(self, c: int, factor: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, factor * c), nn.ReLU(), nn.Linear(factor * c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PairBias(nn.Module):
    """The pair representation as an attention bias: LayerNorm, Linear(c_z -> H), to [B, 1, H, R, R].

    Neither has a bias: a constant added to every logit of a row leaves the softmax unchanged, so its
    gradient is zero up to rounding, which Adam would blow up to full-size steps in a random direction."""

    def __init__(self, c_z: int, heads: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(c_z, bias=False), nn.Linear(c_z, heads, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(z)).permute(0, 3, 1, 2).unsqueeze(1)


def mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """[B, N, L] of 1 / 0 -> DeepSpeed's tutorial key mask [B, N, 1, 1, L], 1e9 * (mask - 1)."""
    return (1e9 * (mask - 1))[:, :, None, None, :]


class EvoformerBlock(nn.Module):
    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        h, d, a = cfg.heads, cfg.head_dim, cfg.attention
        self.row_bias = PairBias(cfg.c_z, h)
        self.msa_row = GatedAttention(cfg.c_m, h, d, a)
        self.msa_col = GatedAttention(cfg.c_m, h, d, a)
        self.msa_transition = Transition(cfg.c_m)
        self.start_bias, self.end_bias = PairBias(cfg.c_z, h), PairBias(cfg.c_z, h)
        self.tri_start = GatedAttention(cfg.c_z, h, d, a)
        self.tri_end = GatedAttention(cfg.c_z, h, d, a)
        self.pair_transition = Transition(cfg.c_z)

    def forward(self, m, z, msa_mask, pair_mask):
        """m [B, S, R, c_m], z [B, R, R, c_z], msa_mask [B, S, R], pair_mask [B, R, R] (1 keep, 0 masked)."""
        m = m + self.msa_row(m, mask_bias(msa_mask), self.row_bias(z))
        m_t = m.transpose(1, 2)  # [B, R, S, c_m]: attention along the sequences of each residue
        m = m + self.msa_col(m_t, mask_bias(msa_mask.transpose(1, 2))).transpose(1, 2)
        m = m + self.msa_transition(m)
        z = z + self.tri_start(z, mask_bias(pair_mask), self.start_bias(z))
        z_t = z.transpose(1, 2)  # around the ending node: the same on the transposed pair
        z = z + self.tri_end(z_t, mask_bias(pair_mask.transpose(1, 2)), self.end_bias(z_t)).transpose(1, 2)
        return m, z + self.pair_transition(z)


class Evoformer(nn.Module):
    """Embeddings of a toy MSA (token ids) and pair features, `blocks` Evoformer blocks, and a regression
    loss on both representations: `model(msa, pair, msa_mask, pair_mask, target_m, target_z)` -> loss."""

    def __init__(self, cfg: EvoformerConfig, vocab: int = 21, pair_features: int = 4) -> None:
        super().__init__()
        self.embed_m = nn.Embedding(vocab, cfg.c_m)
        self.embed_z = nn.Linear(pair_features, cfg.c_z)
        self.blocks = nn.ModuleList(EvoformerBlock(cfg) for _ in range(cfg.blocks))
        self.head_m, self.head_z = nn.Linear(cfg.c_m, 1), nn.Linear(cfg.c_z, 1)

    def forward(self, msa, pair, msa_mask, pair_mask, target_m, target_z):
        m, z = self.embed_m(msa), self.embed_z(pair)
        for block in self.blocks:
            m, z = block(m, z, msa_mask, pair_mask)
        return F.mse_loss(self.head_m(m).squeeze(-1), target_m) + F.mse_loss(self.head_z(z).squeeze(-1), target_z)


def evoformer_batch(batch: int, seqs: int, residues: int, seed: int = 0, vocab: int = 21, pair_features: int = 4):
    """A deterministic toy batch: (msa, pair, msa_mask, pair_mask, target_m, target_z). Masks keep every
    sequence's first residue (no fully masked row) and drop ~20% of the rest."""
    g = torch.Generator().manual_seed(seed)
    msa = torch.randint(0, vocab, (batch, seqs, residues), generator=g)
    pair = torch.randn(batch, residues, residues, pair_features, generator=g)
    msa_mask = (torch.rand(batch, seqs, residues, generator=g) > 0.2).float()
    msa_mask[:, :, 0] = 1
    msa_mask[:, 0, :] = 1
    pair_mask = (torch.rand(batch, residues, residues, generator=g) > 0.2).float()
    pair_mask[:, :, 0] = 1
    pair_mask[:, 0, :] = 1
    target_m = torch.randn(batch, seqs, residues, generator=g)
    target_z = torch.randn(batch, residues, residues, generator=g)
    return msa, pair, msa_mask, pair_mask, target_m, target_z
