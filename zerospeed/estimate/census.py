"""How big is the model? Parameter counts from a module, a transformers config.json or a GPT config.

The estimator needs three numbers: total parameters, the largest layer's parameters (ZeRO-3 gathers
one layer at a time) and, for activations, the transformer shape (layers, hidden, heads). Tensor and
pipeline parallelism need every layer's sizes: a census from a config carries its `TransformerShape`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerospeed.estimate.layout import TransformerShape, largest_module_params, total_params
from zerospeed.zero import full_numel


@dataclass(frozen=True)
class ModelCensus:
    """Parameter counts and (when known) the transformer shape of a model."""

    total_params: int
    largest_layer_params: int
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    shape: TransformerShape | None = None


def census_of_module(model) -> ModelCensus:
    """Count a torch module: shared parameters once; a layer = one module's own parameters."""
    # full_numel: a ZeRO-3 parameter counts its full size, not its local shard.
    total = sum({id(p): full_numel(p) for p in model.parameters()}.values())
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ModelCensus(total, largest)


def transformer_params(
    *,
    layers: int,
    hidden: int,
    vocab: int,
    positions: int = 0,
    ffn: int | None = None,
    tied: bool = True,
    bias: bool = True,
    gated: bool = False,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> ModelCensus:
    """Parameters of a standard decoder: attention 4h^2 (less with fewer kv heads), MLP 2*h*ffn
    (3*h*ffn gated), norms, embeddings; the count is `layout.total_params` of the shape."""
    shape = TransformerShape(layers, hidden, vocab, heads, kv_heads, ffn, positions, tied, bias, gated, head_dim)
    return ModelCensus(
        total_params(shape), largest_module_params(shape), layers, hidden, heads, positions or None, shape
    )


def census_of_config(config: dict[str, Any]) -> ModelCensus:
    """A census from a transformers config.json dict or a zerospeed GPTConfig dict (n_embd, n_layer...)."""
    if "n_embd" in config:  # zoo.models.GPTConfig (and GPT-2 style configs)
        c = transformer_params(
            layers=config["n_layer"],
            hidden=config["n_embd"],
            vocab=config["vocab_size"],
            positions=config.get("block_size", config.get("n_positions", 0)),
            bias=config.get("bias", True),
            ffn=config.get("n_inner"),
            heads=config["n_head"],
            tied=config.get("tie_word_embeddings", True),
        )
        return c
    needed = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    missing = [k for k in needed if k not in config]
    if missing:
        raise ValueError(
            f"model config lacks {', '.join(missing)}; give a transformers config.json "
            "(hidden_size, num_hidden_layers, num_attention_heads, vocab_size) or a GPT config "
            "(n_embd, n_layer, n_head, vocab_size), or pass --params"
        )
    # Llama-family models: gated SiLU MLP (3 matrices), RMSNorm without bias, rotary positions.
    gated = config.get("model_type") in ("llama", "mistral", "qwen2", "gemma") or config.get("hidden_act") in (
        "silu",
        "swiglu",
    )
    c = transformer_params(
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        vocab=config["vocab_size"],
        ffn=config.get("intermediate_size"),
        tied=config.get("tie_word_embeddings", True),
        bias=not gated,
        gated=gated,
        positions=0 if gated else config.get("max_position_embeddings", 0),
        heads=config["num_attention_heads"],
        kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
    )
    return _with(c, seq_len=config.get("max_position_embeddings"))


def census_of_file(path: str | Path) -> ModelCensus:
    """Read a config.json (transformers or GPT) and count it."""
    try:
        return census_of_config(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from exc


def parse_count(text: str) -> int:
    """'7.5B', '350M', '125k' or '1234' -> an integer parameter count."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
    t = text.strip().lower().replace(",", "").replace("_", "")
    try:
        if t and t[-1] in scale:
            return round(float(t[:-1]) * scale[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"not a parameter count: {text!r} (examples: 7.5B, 350M, 125000)") from None


def _with(c: ModelCensus, **kw) -> ModelCensus:
    return ModelCensus(**{**c.__dict__, **kw})
