"""Tensor parallelism: Megatron-style parallel layers, their conjugate collectives, vocabulary-parallel
cross-entropy, and AutoTP sharding of transformers models. See docs/tensor_parallel.md."""

from zerospeed.parallel.tensor.autotp import ShardReport, shard_model, tp_model_init
from zerospeed.parallel.tensor.cross_entropy import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from zerospeed.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
)
from zerospeed.parallel.tensor.mappings import (
    all_reduce_sequence_parallel_grads,
    copy_to_tensor_region,
    gather_from_sequence,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tensor_region,
    sum_over_replicas,
)
from zerospeed.parallel.tensor.partition import ShardSpec, head_layout, valid_attention_tp_sizes, valid_tp_sizes
from zerospeed.parallel.tensor.plan import PRESETS, Rule, resolve_rules
from zerospeed.parallel.tensor.state import (
    full_state_dict,
    gather_full,
    grad_norm_squared,
    param_layouts,
    replica_counts,
)

__all__ = [
    "ColumnParallelLinear",
    "PRESETS",
    "RowParallelLinear",
    "Rule",
    "ShardReport",
    "ShardSpec",
    "TensorParallelModule",
    "VocabParallelCausalLMLoss",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "copy_to_tensor_region",
    "full_state_dict",
    "gather_from_sequence",
    "gather_from_tensor_region",
    "gather_full",
    "grad_norm_squared",
    "head_layout",
    "param_layouts",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence",
    "replica_counts",
    "resolve_rules",
    "scatter_to_sequence",
    "scatter_to_tensor_region",
    "shard_model",
    "sum_over_replicas",
    "tp_model_init",
    "valid_attention_tp_sizes",
    "valid_tp_sizes",
    "vocab_parallel_cross_entropy",
]
