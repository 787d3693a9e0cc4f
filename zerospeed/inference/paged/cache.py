"""The paged KV cache's storage: per layer, one key and one value tensor of `num_blocks * block_size`
token slots [slots, kv_heads, head_dim]. A block is `block_size` consecutive slots, so a block table
(blocks.py) turns into slot indices and reading a sequence's context is one `index_select`."""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes_per_slot(self) -> int:
        k = self.keys[0]
        return 2 * len(self.keys) * k[0].numel() * k.element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_blocks * self.block_size

    def write(self, layer: int, slots: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> None:
        self.keys[layer].index_copy_(0, slots, k_TKD)
        self.values[layer].index_copy_(0, slots, v_TKD)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer].index_select(0, slots), self.values[layer].index_select(0, slots)
