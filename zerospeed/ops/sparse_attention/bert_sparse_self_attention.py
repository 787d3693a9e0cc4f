"""``BertSparseSelfAttention``: a BERT self-attention layer (query/key/value projections) whose
attention is ``SparseSelfAttention``; and the variant that stands in for a transformers layer.

Like DeepSpeed's, it has no dropout on the attention probabilities (transformers' BERT has one).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zerospeed.ops.sparse_attention.block_sparse import block_sparse_attention
from zerospeed.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from zerospeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    """DeepSpeed's ``BertSparseSelfAttention(config, sparsity_config=FixedSparsityConfig(num_heads=4))``.

    ``config`` is a BERT config (``hidden_size``, ``num_attention_heads``); ``forward(hidden_states,
    attention_mask)`` returns the context ``[B, L, hidden]``, the mask being a key-padding mask
    (``[B, L]`` or BERT's extended ``[B, 1, 1, L]``) in ``key_padding_mask_mode`` ('add' by default).
    ``max_seq_length`` (zerospeed's keyword) sizes the layout; DeepSpeed fixed it at 2048.
    """

    def __init__(self, config, sparsity_config: SparsityConfig | None = None, max_seq_length: int = 2048):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={config.hidden_size} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=4)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, hidden]`` -> ``[B, heads, L, head_size]``."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def _heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.transpose_for_scores(proj(hidden_states)) for proj in (self.query, self.key, self.value))

    def _merge(self, context: torch.Tensor) -> torch.Tensor:
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The context layer ``[B, L, hidden]``."""
        query, key, value = self._heads(hidden_states)
        context = self.sparse_self_attention(query, key, value, key_padding_mask=attention_mask)
        return self._merge(context)


def _transformers_mask(mask: torch.Tensor | None, seq_len: int):
    """transformers' 4-D mask ``[B, 1, L, L]`` (bool: True attends; float: additive) as
    ``(key_padding_bias [B, L], attn_bias)``: BERT's padding mask repeats one row per query, which is
    read once instead of block by block."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=torch.float32, device=mask.device).masked_fill(~mask, -math.inf)
    if mask.dim() == 2:
        return mask, None
    if mask.dim() != 4 or mask.shape[-1] != seq_len:
        raise ValueError(f"unsupported attention mask of shape {tuple(mask.shape)} for {seq_len} tokens")
    first_row = mask[:, :, :1, :]
    if mask.shape[1] == 1 and torch.equal(mask, first_row.expand_as(mask)):
        return first_row[:, 0, 0, :], None
    return None, mask


class TransformersBertSparseSelfAttention(BertSparseSelfAttention):
    """``BertSparseSelfAttention`` with transformers' self-attention interface (keyword arguments in,
    ``(context, None)`` out), which ``SparseAttentionUtils`` installs into BERT / RoBERTa models."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ):
        if encoder_hidden_states is not None or cache is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError(
                "sparse self-attention replaces encoder self-attention only (no cross-attention, no key/value cache)"
            )
        query, key, value = self._heads(hidden_states)
        _, heads, seq_len, head_dim = query.shape
        key_padding, attn = _transformers_mask(attention_mask, seq_len)
        attention = self.sparse_self_attention
        context = block_sparse_attention(
            query,
            key,
            value,
            None,
            attention.sparsity_config.block,
            scale=head_dim**-0.5,
            key_padding_mask=key_padding,
            attn_mask=attn,
            plan=attention.plan(seq_len, heads, query.device),
            kernel=attention.kernel,
        )
        return self._merge(context), None


__all__ = ["BertSparseSelfAttention", "TransformersBertSparseSelfAttention"]
