"""Per-rank parameters and activations of a transformer under tensor and pipeline parallelism.

Pure functions of a `TransformerShape` and the degrees (tp, pp): which parameters a rank holds
(Megatron / AutoTP layout), how the layers split over pipeline stages, and Korthikanti et al.'s
activation counts with tensor and sequence parallelism. ZeRO then divides a rank's model states by
the data-parallel size as before (`formulas.stage_bytes`). The layout is the one
`zerospeed.parallel.tensor` builds, checked against a census of a sharded model in the tests:

    q, k, v, MLP up (and gate)  column-parallel: weight and bias split by output (whole heads)
    attention out, MLP down     row-parallel: weight split by input; bias replicated
    LayerNorm / RMSNorm         replicated on every tp rank
    word embedding              vocabulary-parallel (the first V % tp ranks hold one row more)
    position embedding          replicated
    output head                 vocabulary-parallel; a tied head shares the embedding's shard

Note [kv heads under tp]: with grouped-query attention and tp > kv heads every rank holds one kv head
(replicated on tp/kv ranks) instead of idling ranks, so k and v do not shrink below one head.
Note [tied head under pp]: with pp > 1 the last stage keeps its own copy of a tied embedding for
the head (DeepSpeed's TiedLayerSpec, Megatron's word-embedding copy), so it is counted on both ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerospeed.parallel.tensor.partition import valid_attention_tp_sizes, valid_tp_sizes


@dataclass(frozen=True)
class TransformerShape:
    """A decoder's sizes: enough to place every parameter on a (tp, pp) rank."""

    layers: int
    hidden: int
    vocab: int
    heads: int | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    positions: int = 0
    tied: bool = True
    bias: bool = True
    gated: bool = False
    head_dim: int | None = None

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def n_heads(self) -> int:
        return self.heads or 1

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden if self.bias else self.hidden  # LayerNorm (weight, bias) or RMSNorm


def local_kv_heads(heads: int, kv_heads: int, tp: int) -> int:
    """kv heads on one rank: kv/tp, or one replicated head when tp > kv (Note [kv heads under tp])."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def layer_modules(shape: TransformerShape, tp: int = 1) -> dict[str, tuple[int, int]]:
    """One block's modules on tp rank 0: {name: (sharded parameters held, replicated parameters)}.
    GPT-style blocks fuse q, k, v into one projection; gated (Llama-style) blocks keep them apart."""
    h, b, d = shape.hidden, int(shape.bias), shape.head_size
    q = shape.n_heads // tp * d
    kv = local_kv_heads(shape.n_heads, shape.n_kv_heads, tp) * d
    ffn = shape.ffn_size // tp
    column = lambda rows: (rows * (h + b), 0)  # weight [rows, h] and bias [rows], both split
    if shape.gated:
        mods = {
            "attn.q": column(q),
            "attn.k": column(kv),
            "attn.v": column(kv),
            "attn.o": (q * h, b * h),
            "mlp.gate": column(ffn),
            "mlp.up": column(ffn),
            "mlp.down": (ffn * h, b * h),
        }
    else:
        mods = {
            "attn.qkv": column(q + 2 * kv),
            "attn.out": (q * h, b * h),
            "mlp.fc": column(ffn),
            "mlp.proj": (ffn * h, b * h),
        }
    return {**mods, "norm_1": (0, shape.norm_params), "norm_2": (0, shape.norm_params)}


def vocab_rows(vocab: int, tp: int) -> int:
    """Vocabulary rows on tp rank 0 (the largest share of an uneven split)."""
    return math.ceil(vocab / tp)


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: an even split, the first layers % pp stages one layer more."""
    return [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]


def stage_params(shape: TransformerShape, tp: int = 1, pp: int = 1) -> list[int]:
    """Parameters held by tp rank 0 of every pipeline stage (first: embeddings; last: final norm, head)."""
    per_layer = sum(a + r for a, r in layer_modules(shape, tp).values())
    embed = vocab_rows(shape.vocab, tp) * shape.hidden
    head = embed if (not shape.tied or pp > 1) else 0  # Note [tied head under pp]
    out = []
    for i, n in enumerate(stage_layers(shape.layers, pp)):
        p = n * per_layer
        if i == 0:
            p += embed + shape.positions * shape.hidden
        if i == pp - 1:
            p += shape.norm_params + head
        out.append(p)
    return out


def largest_module_params(shape: TransformerShape, tp: int = 1) -> int:
    """The largest single module on a rank (what ZeRO-3 gathers at once): a block's projection or the
    embedding shard."""
    mods = [a + r for a, r in layer_modules(shape, tp).values()]
    return max(*mods, vocab_rows(shape.vocab, tp) * shape.hidden)


def total_params(shape: TransformerShape) -> int:
    """The whole model's parameters (one process, a tied head counted once)."""
    return stage_params(shape, 1, 1)[0]


# -- activations ---------------------------------------------------------------------------------------
def layer_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 2,
    attention: str = "sdpa",
) -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, 16-bit activations):

        no tp                   s*b*h*(34 + 5*a*s/h)
        tp = t                  s*b*h*(10 + 24/t + 5*a*s/(h*t))   (LayerNorm/dropout regions replicated)
        tp = t, sequence par.   s*b*h*(34 + 5*a*s/h) / t

    The 5*a*s/h term is the [a, s, s] attention scores, softmax and dropout mask that `attention="eager"`
    keeps; fused attention (`"sdpa"`, the default of PyTorch and transformers: FlashAttention or the
    memory-efficient kernel) keeps none of them, only its output and a log-sum-exp per row. Measured on
    one H200 (bf16 GPT, seq 1024, micro batch 4, sdpa; docs/benchmarks.md): device peak minus model
    states 12.5 GB at 2.65 B and 20.0 GB at 6.65 B parameters, against 11.4 / 18.3 GB for 34*s*b*h per
    layer (the rest is the logits) and 32.9 / 39.7 GB with the scores term. `act_bytes` 4 doubles
    everything (fp32 activations)."""
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    scores = 5 * a * s / h if attention == "eager" else 0.0
    if sequence_parallel:
        per = s * b * h * (34 + scores) / t
    else:
        per = s * b * h * (10 + 24 / t + scores / t)
    return per * act_bytes / 2


def in_flight(stage: int, pp: int, micro_batches: int | None = None) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B: pp - stage (the first
    stage warms up with pp forwards), at most the micro-batches of one step."""
    n = pp - stage
    return n if micro_batches is None else max(1, min(n, micro_batches))


def stage_activation_bytes(
    *,
    layers: int,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    checkpointing: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    micro_batches_in_flight: int = 1,
    act_bytes: int = 2,
    attention: str = "sdpa",
) -> float:
    """Activations of a stage of `layers` layers holding `micro_batches_in_flight` micro-batches.

    With full activation checkpointing each layer keeps only its 16-bit input, 2*s*b*h (split by tp
    under sequence parallelism), per micro-batch in flight, and one layer's activations are live again
    while it is recomputed."""
    per_layer = layer_activation_bytes(
        seq_len=seq_len,
        micro_batch=micro_batch,
        hidden=hidden,
        heads=heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        act_bytes=act_bytes,
        attention=attention,
    )
    if not checkpointing:
        return layers * per_layer * micro_batches_in_flight
    kept = 2 * seq_len * micro_batch * hidden * act_bytes / 2 / (tp if sequence_parallel else 1)
    return layers * kept * micro_batches_in_flight + per_layer


# -- validation ----------------------------------------------------------------------------------------
def valid_tp(shape: TransformerShape, limit: int = 64) -> list[int]:
    """tp sizes the shape splits over: whole query heads (kv heads divide or are replicated), the MLP."""
    by_heads = set(valid_attention_tp_sizes(shape.n_heads, shape.n_kv_heads, limit=limit))
    return [t for t in valid_tp_sizes(shape.ffn_size, limit=limit) if t in by_heads]


def check_layout(
    shape: TransformerShape | None,
    world: int,
    tp: int,
    pp: int,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> int:
    """Validate a (tp, pp) choice for `world` devices; return dp. Errors name the flag and valid values."""
    for flag, v in (("--tp", tp), ("--pp", pp)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if tp * pp > 1 and shape is None:
        raise ValueError(
            "--tp/--pp need the model's layer shapes: give --model-config (a transformers or GPT config.json)"
        )
    if tp > 1 and shape.heads is None:
        raise ValueError("--tp needs the attention head count: the model config lacks it")
    if shape is not None and pp > shape.layers:
        raise ValueError(f"--pp {pp} exceeds the model's {shape.layers} layers; valid --pp: 1 to {shape.layers}")
    if world % pp:
        pps = [p for p in valid_tp_sizes(world, limit=world) if shape is None or p <= shape.layers]
        raise ValueError(
            f"--pp {pp} does not divide the {world} devices (--devices-per-node x --nodes); valid --pp: {pps}"
        )
    model_tps = valid_tp(shape, limit=world) if tp > 1 else [1]
    fits = [t for t in valid_tp_sizes(world // pp, limit=world) if t == 1 or t in model_tps]
    if tp not in fits:
        model = (
            f" and the model's {shape.n_heads} query heads ({shape.n_kv_heads} kv heads; more tp ranks than "
            f"kv heads replicate them) and MLP width {shape.ffn_size}"
            if shape is not None
            else ""
        )
        raise ValueError(
            f"--tp {tp} must divide the {world // pp} devices of a pipeline stage (--devices-per-node x "
            f"--nodes / --pp {pp}){model}; valid --tp with --pp {pp}: {fits}"
        )
    if sequence_parallel and seq_len and seq_len % tp:
        raise ValueError(f"--sequence-parallel needs --seq-len divisible by --tp {tp}, got {seq_len}")
    return world // (tp * pp)
