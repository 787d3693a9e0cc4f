"""DeepSpeed's ``deepspeed.ops.sparse_attention`` in pure PyTorch: the sparsity configs (block
layouts built by DeepSpeed's rules), ``SparseSelfAttention``, ``BertSparseSelfAttention`` and
``SparseAttentionUtils``, on kernels that compute only the active blocks (``block_sparse``).
See docs/sparse_attention.md.
"""

from zerospeed.ops.sparse_attention.bert_sparse_self_attention import (
    BertSparseSelfAttention,
    TransformersBertSparseSelfAttention,
)
from zerospeed.ops.sparse_attention.block_sparse import BlockSparsePlan, block_sparse_attention
from zerospeed.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
from zerospeed.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from zerospeed.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    build_sparsity_config,
)

__all__ = [
    "SparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "VariableSparsityConfig",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "BertSparseSelfAttention",
    "SparseAttentionUtils",
    "TransformersBertSparseSelfAttention",
    "BlockSparsePlan",
    "block_sparse_attention",
    "build_sparsity_config",
]
