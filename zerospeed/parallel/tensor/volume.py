"""The analytic communication volume of a tensor-parallel training step (forward + backward), per rank.

Payload bytes as `comm.STATS` counts them (all-reduce: the tensor; all-gather: the output;
reduce-scatter: the input); wire bytes per rank are payload x 2(P-1)/P for all-reduce and (P-1)/P
for the others (`comm.wire_fraction`). With T tokens per micro-batch, b bytes per activation element:

    ColumnParallelLinear(in, out)        backward all-reduce of dL/dx:        T * in * b
        + gather_output                  forward all-gather of y:             T * out * b
        + sequence_parallel (instead)    forward all-gather T*in*b, backward reduce-scatter T*in*b
        + replicated kv heads            backward all-reduce of the weight
                                         (and bias) gradient, every replica:  slots * |W_local| * b
    RowParallelLinear(in, out)           forward all-reduce of y:             T * out * b
        + sequence_parallel (instead)    forward reduce-scatter T*out*b, backward all-gather T*out*b
        + not input_is_parallel          backward all-gather of dL/dx:        T * in * b
    VocabParallelEmbedding(V, D)         forward all-reduce:                  T * D * b
        + sequence_parallel (instead)    forward reduce-scatter T*D*b, backward all-gather T*D*b
    vocab_parallel_cross_entropy         forward all-reduces: max, then
                                         (sum-exp, target logit), fp32:       T * 4 + 2 * T * 4

The backward all-reduce of a column layer happens only when its input requires grad (it does
everywhere past the embedding). A step of G micro-batches moves G times this.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from zerospeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def layer_bytes(module: nn.Module, tokens: int, elem_bytes: int = 4) -> Counter:
    """{collective kind: payload bytes} one forward + backward of `module` moves on each rank."""
    out: Counter = Counter()
    if getattr(module, "tp_size", 1) == 1:
        return out
    if isinstance(module, ColumnParallelLinear):
        if module.sequence_parallel:
            out["all_gather"] += tokens * module.in_features * elem_bytes
            out["reduce_scatter"] += tokens * module.in_features * elem_bytes
        else:
            out["all_reduce"] += tokens * module.in_features * elem_bytes
        if module.gather_output:
            out["all_gather"] += tokens * module.out_features * elem_bytes
        if module._replica is not None:
            slots = module._replica[1]
            params = [module.weight] + ([module.bias] if module.bias is not None else [])
            out["all_reduce"] += sum(slots * p.numel() * p.element_size() for p in params)
    elif isinstance(module, RowParallelLinear):
        kind = "reduce_scatter" if module.sequence_parallel else "all_reduce"
        out[kind] += tokens * module.out_features * elem_bytes
        if module.sequence_parallel:
            out["all_gather"] += tokens * module.out_features * elem_bytes
        if not module.input_is_parallel:
            out["all_gather"] += tokens * module.in_features * elem_bytes
    elif isinstance(module, VocabParallelEmbedding):
        kind = "reduce_scatter" if module.sequence_parallel else "all_reduce"
        out[kind] += tokens * module.embedding_dim * elem_bytes
        if module.sequence_parallel:  # the reduce-scatter's backward
            out["all_gather"] += tokens * module.embedding_dim * elem_bytes
    return out


def cross_entropy_bytes(tokens: int) -> Counter:
    """The vocab-parallel cross-entropy's three fp32 floats per token (two all-reduces)."""
    return Counter({"all_reduce": 3 * tokens * 4})


def model_step_bytes(
    model: nn.Module, tokens: int, *, loss_tokens: int | None = None, elem_bytes: int = 4
) -> dict[str, int]:
    """{kind: payload bytes} of one forward + backward of a tensor-parallel `model` on `tokens` tokens,
    with the vocab-parallel loss over `loss_tokens` (None: no vocab-parallel loss)."""
    total: Counter = Counter()
    for module in model.modules():
        total += layer_bytes(module, tokens, elem_bytes)
    if loss_tokens is not None:
        total += cross_entropy_bytes(loss_tokens)
    return dict(total)
