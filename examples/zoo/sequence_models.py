"""A tiny GPT whose attention is injected: plain SDPA over the whole sequence (the one-process
reference) or `DistributedAttention` around it (Ulysses). Used by the sequence-parallel tests and
benchmarks/sequence_parallel.py."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

import zerospeed

VOCAB = 32


def local_sdpa(q, k, v):
    """[b, s, h, d] causal attention (GQA by SDPA's own head grouping)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, attention):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # no bias: a key bias has an exactly-zero gradient, which Adam would turn rounding noise into steps of
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.attention = attention

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1
        )
        ctx = self.attention(
            q.view(b, s, self.heads, self.hd),
            k.view(b, s, self.kv_heads, self.hd),
            v.view(b, s, self.kv_heads, self.hd),
        )
        x = x + self.proj(ctx.reshape(b, s, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width, heads, kv_heads, attention, layers=2, checkpoint=False, max_pos=64, vocab=VOCAB):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_pos, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads, attention) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.checkpoint = checkpoint

    def hidden(self, ids, pos):
        """[b, s] token ids at global positions `pos` -> the final normalised hidden states [b, s, width]."""
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = zerospeed.activation.checkpoint(block, x) if self.checkpoint else block(x)
        return self.ln(x)

    def logits(self, ids, pos):
        """[b, s] token ids at global positions `pos` -> [b, s, vocab]."""
        return self.head(self.hidden(ids, pos))
