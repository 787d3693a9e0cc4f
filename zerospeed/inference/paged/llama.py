"""A Llama-family forward over the paged KV cache, for a ragged batch of sequences.

It reuses the transformers model's own modules (embedding, norms, projections, MLP, rotary embedding)
and replaces only what the paged cache changes: the tokens of all sequences in a step are one flat
[T, hidden] batch (no padding: linear layers see only real tokens), each new key/value goes to its
sequence's slots, and each sequence's attention reads its context through its block table. Works for
models shaped like `LlamaForCausalLM` (`model.layers[i].self_attn.{q,k,v,o}_proj`, `.mlp`, RMSNorms,
`model.rotary_emb`): Llama, Mistral without a sliding window, Qwen2 (biased q/k/v).

Note [paged attention]: sequence s's new queries sit at positions [start, stop) of its context of
`stop` tokens; query at position p sees keys at positions <= p. Each sequence's context is gathered
from its slots (one indexing of the layer's cache for the whole step), the step's sequences padded to
the longest new-token count and context, and attention runs as one batched matmul with a mask that
hides the other positions and the padding (masked scores are exactly 0 after the softmax, so padding
does not change the result). A fused kernel would read the blocks in place instead of gathering them.

Note [paged attention under tp]: a model sharded by AutoTP (`init_inference(tensor_parallel=...)`)
runs this same forward. q/k/v_proj are column-parallel, so each rank computes only its own query and kv
heads (a kv head shared by several ranks' query heads is replicated on them), and the `.view(..., -1,
head_dim)` below takes the local head count; each rank's cache holds its own kv heads only, 1/tp of
the cache when kv heads divide by tp. o_proj and the MLP's down projection all-reduce, the embedding is
vocabulary-parallel (all-reduced) and the head gathers full logits (Note [full logits at inference] in
inference/tp.py), so every rank samples from the same logits and the schedulers, which see only
token ids, stay in step without exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.inference.paged.cache import PagedKVCache


def check_supported(model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    ok = (
        layers is not None
        and hasattr(inner, "rotary_emb")
        and hasattr(model, "lm_head")
        and all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_proj") for layer in layers)
    )
    if not ok:
        raise TypeError(
            f"the paged server runs Llama-family models (LlamaForCausalLM, MistralForCausalLM, "
            f"Qwen2ForCausalLM); {type(model).__name__} does not have their layout"
        )
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True) and window < model.config.max_position_embeddings:
        raise TypeError(f"sliding-window attention (sliding_window={window}) is not implemented in the paged server")


@torch.inference_mode()
def local_kv_heads(model: nn.Module) -> int:
    """The kv heads this rank computes (Note [paged attention under tp]): the config's count unsharded;
    under AutoTP the column-parallel k_proj's own heads. Read from one probe token through k_proj, so
    any layout of its weight (sharded, quantized) answers the same way."""
    attn = model.model.layers[0].self_attn
    weight = next(model.parameters())
    probe = torch.zeros(1, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
    return attn.k_proj(probe).shape[-1] // attn.head_dim


def cache_for(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype) -> PagedKVCache:
    attn = model.model.layers[0].self_attn
    return PagedKVCache(
        num_layers=len(model.model.layers),
        num_blocks=num_blocks,
        block_size=block_size,
        kv_heads=local_kv_heads(model),
        head_dim=attn.head_dim,
        dtype=dtype,
        device=next(model.parameters()).device,
    )


@dataclass(frozen=True)
class StepLayout:
    """Index tensors of one step, shared by every layer (Note [paged attention]): S sequences, the step's
    T tokens flat, padded to N new tokens and C context slots per sequence."""

    write_at: torch.Tensor  # [T] cache slot of each new token
    read_at: torch.Tensor  # [S, C] context slots (pad: slot 0, masked)
    query_at: torch.Tensor  # [S, N] flat token index of each sequence's i-th new token (pad: 0)
    visible: torch.Tensor  # [S, 1, N, C] key j visible to new token i
    unpad: torch.Tensor  # [T] row of [S * N] holding each flat token

    @classmethod
    def build(
        cls, starts: list[int], lengths: list[int], new_slots: list[list[int]], context_slots: list[list[int]], device
    ) -> StepLayout:
        n, c = max(lengths), max(len(x) for x in context_slots)
        read_at = torch.tensor([x + [0] * (c - len(x)) for x in context_slots], device=device)
        offsets = [sum(lengths[:s]) for s in range(len(lengths))]
        rows = [[o + i if i < k else 0 for i in range(n)] for o, k in zip(offsets, lengths, strict=True)]
        query_at = torch.tensor(rows, device=device)
        key_pos = torch.arange(c, device=device)
        q_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)[None, :]  # [S, N]
        ctx_len = torch.tensor([len(x) for x in context_slots], device=device)
        visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < ctx_len[:, None, None])
        unpad = torch.tensor([s * n + i for s, k in enumerate(lengths) for i in range(k)], device=device)
        write_at = torch.tensor([x for seq in new_slots for x in seq], device=device)
        return cls(write_at, read_at, query_at, visible[:, None], unpad)


def _attend(
    attn: nn.Module, q_THD: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepLayout
) -> torch.Tensor:
    """Note [paged attention], every sequence of the step at once: [T, H, D] queries -> [T, H * D]."""
    q = q_THD[step.query_at].transpose(1, 2)  # [S, H, N, D]
    k = keys[step.read_at].transpose(1, 2)  # [S, KV, C, D]
    v = values[step.read_at].transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * attn.scaling  # [S, H, N, C]
    scores = scores.masked_fill(~step.visible, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2)  # [S, N, H, D]
    return out.reshape(-1, out.shape[2] * out.shape[3])[step.unpad]


@torch.inference_mode()
def paged_forward(
    model: nn.Module,
    cache: PagedKVCache,
    ids: list[list[int]],
    starts: list[int],
    new_slots: list[list[int]],
    context_slots: list[list[int]],
) -> torch.Tensor:
    """Last-position logits [S, V] of S sequences; sequence s brings tokens `ids[s]` at positions
    starts[s] .. starts[s] + len(ids[s]) - 1, written to `new_slots[s]`; its context is `context_slots[s]`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    device = cache.keys[0].device
    lengths = [len(t) for t in ids]
    step = StepLayout.build(starts, lengths, new_slots, context_slots, device)
    flat = torch.tensor([t for seq in ids for t in seq], device=device)
    positions = torch.tensor([p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)], device=device)
    h = model.model.embed_tokens(flat)[None]  # [1, T, hidden]: one flat batch of every sequence's tokens
    cos, sin = model.model.rotary_emb(h, positions[None])
    for layer_index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, len(flat), -1, attn.head_dim).transpose(1, 2)  # [1, H, T, D]
        k = attn.k_proj(x).view(1, len(flat), -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, len(flat), -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache.write(layer_index, step.write_at, k[0].transpose(0, 1), v[0].transpose(0, 1))
        o = _attend(attn, q[0].transpose(0, 1), cache.keys[layer_index], cache.values[layer_index], step)
        h = h + attn.o_proj(o[None])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = torch.tensor([sum(lengths[: s + 1]) - 1 for s in range(len(lengths))], device=device)
    return model.lm_head(model.model.norm(h)[0, last])
