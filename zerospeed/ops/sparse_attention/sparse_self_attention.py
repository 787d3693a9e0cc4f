"""``SparseSelfAttention``: DeepSpeed's block-sparse self-attention module on the pure-PyTorch kernels.

The module builds the layout once for ``max_seq_length`` (the ``master_layout`` buffer) and uses its
top-left ``L/block x L/block`` corner for a sequence of ``L`` tokens, as DeepSpeed does; on the first
call in a distributed job the layout is broadcast from rank 0 (random blocks differ between ranks
otherwise). Index tables are cached per sequence length on this instance (DeepSpeed's cache was one
class-wide dict keyed by length, shared by modules with different configs).
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed import comm
from zerospeed.ops.sparse_attention.block_sparse import KERNELS, MASK_MODES, BlockSparsePlan, block_sparse_attention
from zerospeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (Child et al., 2019) over ``[B, H, L, D]`` queries, keys and values.

    Arguments are DeepSpeed's: ``sparsity_config`` (default ``FixedSparsityConfig(num_heads=4)``;
    DeepSpeed's default, the abstract ``SparsityConfig``, has no layout), ``key_padding_mask_mode`` and
    ``attn_mask_mode`` ('add': the mask is added to the scores; 'mul': zeros mask a key out), and
    ``max_seq_length``, the longest sequence the layout covers. ``kernel`` (zerospeed's) is
    'auto' (flex_attention on CUDA, the gather path elsewhere), 'gather' or 'flex'.
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        kernel: str = "auto",
    ):
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name}={mode!r}: expected 'add' or 'mul'")
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
        self.sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.kernel = kernel
        self._plans: dict[tuple[int, int, torch.device], BlockSparsePlan] = {}

    def get_layout(self, L: int) -> torch.Tensor:
        """The ``[heads, L/block, L/block]`` layout for ``L`` tokens (a corner of the master layout)."""
        if self._need_layout_synchronization:
            self._synchronize_layout()
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(
                f"sequence length {L} is not a multiple of the block size {block}; "
                "pad it (SparseAttentionUtils.pad_to_block_size)"
            )
        if L > self.max_seq_length:
            raise ValueError(
                f"sequence length {L} exceeds max_seq_length={self.max_seq_length} of this "
                "SparseSelfAttention; build it with a larger max_seq_length"
            )
        num_blocks = L // block
        return self.master_layout[..., :num_blocks, :num_blocks]

    def _synchronize_layout(self) -> None:
        if comm.is_initialized():
            comm.broadcast(self.master_layout, src=0)
            self._plans.clear()
        self._need_layout_synchronization = False

    def plan(self, L: int, heads: int, device: torch.device) -> BlockSparsePlan:
        """The cached index tables for ``L`` tokens and ``heads`` heads on ``device``."""
        key = (L, heads, device)
        if key not in self._plans:
            layout = self.get_layout(L)
            if layout.shape[0] != heads:
                if bool((layout != layout[:1]).any()):
                    raise ValueError(
                        f"the sparsity config has {layout.shape[0]} heads with different layouts "
                        f"but the input has {heads} heads"
                    )
                layout = layout[:1].expand(heads, -1, -1)
            self._plans[key] = BlockSparsePlan(layout, self.sparsity_config.block, device)
        return self._plans[key]

    @staticmethod
    def transpose_key_for_scores(x: torch.Tensor, L: int) -> torch.Tensor:
        """Keys given as ``[B, H, D, L]`` are turned back into ``[B, H, L, D]``."""
        return x.permute(0, 1, 3, 2) if x.size(2) != L else x

    @staticmethod
    def transpose_mask_for_sparse(qtype: torch.dtype, x: torch.Tensor, is_key_padding_mask: bool = False):
        """Squeeze a mask as DeepSpeed does: a key-padding mask to ``[B, L]`` (every size-1 dim after
        the batch), an attention mask to ``[L, L]``; a 4-D attention mask ``[B|1, H|1, L, L]`` is kept."""
        x = x.type(qtype) if x.dtype != torch.bool else x
        if is_key_padding_mask:
            for dim in range(x.dim() - 1, 0, -1):
                x = x.squeeze(dim)
            return x
        return x if x.dim() == 4 else x.squeeze()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        causal: bool = False,
    ) -> torch.Tensor:
        """Attention output ``[B, H, L, D]``.

        ``rpe`` (``[B|1, H|1, L, L]``) is added to the scaled scores; ``key_padding_mask`` is
        ``[B, L]`` (or ``[B, 1, 1, L]``); ``attn_mask`` is ``[L, L]`` (or ``[B|1, H|1, L, L]``).
        Masks and rpe receive no gradient, as in DeepSpeed. ``causal`` (zerospeed's) also hides later
        tokens inside active blocks.
        """
        _, heads, tgt_len, head_dim = query.shape
        key = self.transpose_key_for_scores(key, tgt_len)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError("only self-attention (query, key and value of one shape) is supported")
        if key_padding_mask is not None:
            key_padding_mask = self.transpose_mask_for_sparse(query.dtype, key_padding_mask, is_key_padding_mask=True)
        if attn_mask is not None:
            attn_mask = self.transpose_mask_for_sparse(query.dtype, attn_mask)
        return block_sparse_attention(
            query,
            key,
            value,
            None,
            self.sparsity_config.block,
            scale=float(head_dim) ** -0.5,
            rpe=rpe,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            key_padding_mask_mode=self.key_padding_mask_mode,
            attn_mask_mode=self.attn_mask_mode,
            causal=causal,
            plan=self.plan(tgt_len, heads, query.device),
            kernel=self.kernel,
        )


__all__ = ["SparseSelfAttention"]
