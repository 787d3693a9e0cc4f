"""``SparseAttentionUtils``: fit a transformers BERT / RoBERTa model with sparse self-attention.

Deviations from DeepSpeed, each where DeepSpeed's version breaks on today's transformers or
leaves garbage behind:

- the replacement is a ``TransformersBertSparseSelfAttention`` (transformers' keyword interface
  and ``(context, None)`` return) whose layout covers ``max(2048, max_position)`` tokens;
  ``replace_model_self_attention_with_sparse_self_attention`` also accepts a bare
  ``BertModel`` / ``RobertaModel``, and its default sparsity config is
  ``FixedSparsityConfig(num_attention_heads)`` (DeepSpeed's default, the abstract base, has no layout);
- ``extend_position_embedding`` makes exactly ``max_position`` rows (tiling the trained rows; DeepSpeed
  kept ``orig * (max_position // orig)``), keeps RoBERTa's two reserved rows (DeepSpeed left them
  uninitialised) and extends the ``position_ids`` / ``token_type_ids`` buffers transformers reads;
- ``pad_to_block_size`` accepts a missing ``attention_mask`` (the padding is then masked) or
  ``token_type_ids``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerospeed.ops.sparse_attention.bert_sparse_self_attention import TransformersBertSparseSelfAttention
from zerospeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)


def _backbone(model) -> tuple[str, torch.nn.Module]:
    """('bert' | 'roberta', the encoder-carrying module) of a task model or a bare base model."""
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in ("bert", "roberta") and hasattr(model, "encoder"):
        return kind, model
    raise ValueError(
        f"{type(model).__name__}: only BERT and RoBERTa models (a `bert` / `roberta` attribute or "
        "a BertModel / RobertaModel) are supported"
    )


def _tile_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    repeats = -(-count // rows.shape[0])
    return rows.repeat(repeats, *([1] * (rows.dim() - 1)))[:count]


def _extend_buffer(embeddings: torch.nn.Module, name: str, size: int) -> None:
    buffer = getattr(embeddings, name, None)
    if isinstance(buffer, torch.Tensor) and buffer.dim() == 2 and buffer.shape[1] < size:
        if name == "position_ids":
            new = torch.arange(size, dtype=buffer.dtype, device=buffer.device)[None]
        else:
            new = buffer.new_zeros(1, size)
        embeddings.register_buffer(name, new, persistent=name in embeddings.state_dict())


class SparseAttentionUtils:
    """DeepSpeed's helpers for adapting a pretrained model to sparse self-attention."""

    @staticmethod
    def extend_position_embedding(model, max_position: int):
        """Grow the position embeddings to ``max_position`` positions by repeating the trained ones."""
        kind, backbone = _backbone(model)
        embeddings = backbone.embeddings
        table = embeddings.position_embeddings
        reserved = 2 if kind == "roberta" else 0  # RoBERTa's positions start after padding_idx=1
        original = table.weight.shape[0] - reserved
        if max_position <= original:
            raise ValueError(f"max_position={max_position} must exceed the current {original} positions")
        with torch.no_grad():
            weight = torch.cat([table.weight[:reserved], _tile_rows(table.weight[reserved:], max_position)])
        table.weight = torch.nn.Parameter(weight, requires_grad=table.weight.requires_grad)
        table.num_embeddings = weight.shape[0]
        for name in ("position_ids", "token_type_ids"):
            _extend_buffer(embeddings, name, weight.shape[0])
        model.config.max_position_embeddings = weight.shape[0]
        logger.info("Extended position embeddings from %d to %d positions", original, max_position)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position: int):
        """Set the tokenizer's ``model_max_length`` (and its init kwargs) to ``max_position``."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        logger.info("Updated the tokenizer's model_max_length to %d", max_position)
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model, max_position: int, sparsity_config: SparsityConfig | None = None
    ):
        """Replace every encoder self-attention of a BERT / RoBERTa model by sparse self-attention."""
        kind, backbone = _backbone(model)
        model.config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=model.config.num_attention_heads)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, backbone.encoder.layer, sparsity_config
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config, layers, sparsity_config: SparsityConfig | None = None
    ):
        """Swap ``layer.attention.self`` of each layer for a sparse one that reuses its projections."""
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=config.num_attention_heads)
        max_seq_length = max(2048, config.max_position_embeddings)
        for layer in layers:
            old = layer.attention.self
            new = TransformersBertSparseSelfAttention(config, sparsity_config, max_seq_length=max_seq_length)
            new.query, new.key, new.value = old.query, old.key, old.value
            new.to(old.query.weight.device)
            layer.attention.self = new
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids,
        attention_mask,
        token_type_ids,
        position_ids,
        inputs_embeds,
        pad_token_id: int,
        model_embeddings,
    ):
        """Pad the inputs on the sequence dimension to a multiple of ``block_size``.

        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``:
        ids and positions padded with ``pad_token_id``, the attention mask with 0 (padding is not
        attended), token types with 0, and ``inputs_embeds`` with ``model_embeddings(pad ids)``.
        Call ``unpad_sequence_output(pad_len, output)`` on the encoder output.
        """
        batch_size, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            pad_ids = torch.full((batch_size, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is None:
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
        attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the ``pad_len`` padded positions from ``[B, L, ...]``."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output


__all__ = ["SparseAttentionUtils"]
