"""Block-sparsity layouts with DeepSpeed's names, parameters, defaults and rules.

A layout is an int64 tensor ``[num_heads, num_blocks, num_blocks]``: entry ``[h, i, j]`` is 1 when the
``block x block`` tile of queries ``i`` and keys ``j`` is computed for head ``h``. ``make_layout(seq_len)``
builds the same tensor as DeepSpeed for the same arguments and the same state of Python's ``random``
module: BigBird and Variable draw their random blocks with ``random.sample``, one call per block row,
rows in order, heads in order (only the heads that get their own layout), exactly as DeepSpeed does.

Note [block-level direction]: ``attention="unidirectional"`` removes the blocks above the diagonal;
the diagonal tiles stay whole, so a token still sees the later tokens of its own block. DeepSpeed
behaves the same way; pass a causal ``attn_mask`` (or ``causal=True`` to the kernel) for token-level
causality.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerospeed.config.schema.techniques import SparseAttentionConfig

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_direction(attention: str) -> None:
    if attention not in _DIRECTIONS:
        raise NotImplementedError(
            f"attention={attention!r}: only 'unidirectional' and 'bidirectional' attention are supported"
        )


def _check_global_windows(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if any(idx < 0 for idx in starts):
        raise ValueError(f"global_block_indices={list(starts)}: block indices must be >= 0")
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_indices has {len(starts)} entries but global_block_end_indices has "
            f"{len(ends)}; give one end index per start index"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block window [{start}, {end}): the start index must be smaller than the end")


def _check_fits(name: str, count: int, num_blocks: int) -> None:
    if num_blocks < count:
        raise ValueError(
            f"{name}={count} is larger than the {num_blocks} blocks of a row (use a longer sequence or fewer {name})"
        )


class SparsityConfig:
    """The shared part of every sparsity pattern: heads, block size, one layout or one per head."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for ``seq_len`` tokens; ``seq_len`` must be a multiple of ``block``."""
        if seq_len % self.block != 0:
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of the block size {self.block}; "
                "pad it (SparseAttentionUtils.pad_to_block_size)"
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1 : self.num_heads] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` tokens; each pattern defines it."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no pattern; use DenseSparsityConfig, "
            "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
            "BSLongformerSparsityConfig or LocalSlidingWindowSparsityConfig"
        )

    def _build(self, seq_len: int, *steps) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for head in range(self.num_layout_heads):
            for step in steps:
                layout = step(head, layout)
        return self.check_and_propagate_first_head_layout(layout)


class DenseSparsityConfig(SparsityConfig):
    """Every block is active: dense attention expressed as a layout (for comparison)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """All ones."""
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _set_window(layout: torch.Tensor, head: int, start: int, stop: int, unidirectional: bool) -> None:
    """Blocks [start, stop) attend to each other (to themselves and earlier ones if unidirectional)."""
    for row in range(start, stop):
        layout[head, row, start : (row + 1 if unidirectional else stop)] = 1


def _set_sliding_window(layout: torch.Tensor, head: int, window: int, backward_only: bool = False) -> None:
    """Row ``r`` sees blocks ``r - window//2 .. r + window//2`` (only up to ``r`` if ``backward_only``)."""
    num_blocks = layout.shape[1]
    _check_fits("num_sliding_window_blocks", window, num_blocks)
    half = window // 2
    for row in range(num_blocks):
        stop = row + 1 if backward_only else min(row + half + 1, num_blocks)
        layout[head, row, max(0, row - half) : stop] = 1


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (Child et al., 2019) as DeepSpeed customised it.

    Local windows of ``num_local_blocks`` blocks attend within themselves; in each window the last
    ``num_global_blocks`` blocks (shifted one group earlier per head for
    ``num_different_global_patterns > 1``) are global: every row (every later row if unidirectional)
    attends to them, and with ``horizontal_global_attention`` they attend to every block.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} must be a multiple of num_global_blocks={num_global_blocks}"
            )
        _check_direction(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs "
                "different_layout_per_head=True (one layout cannot hold several patterns)"
            )
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} exceeds "
                f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Consecutive windows of ``num_local_blocks`` blocks (the last one may be shorter)."""
        num_blocks = layout.shape[1]
        for start in range(0, num_blocks, self.num_local_blocks):
            stop = min(start + self.num_local_blocks, num_blocks)
            _set_window(layout, h, start, stop, self.attention == "unidirectional")
        return layout

    def _set_global_columns(self, h: int, layout: torch.Tensor, start: int, stop: int) -> None:
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:stop] = 1
        if self.horizontal_global_attention:
            layout[h, start:stop, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Global blocks of head ``h``; a short last window gets its own, clamped to the sequence end."""
        num_blocks = layout.shape[1]
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full_end = num_blocks - num_blocks % self.num_local_blocks
        for start in range(offset, full_end, self.num_local_blocks):
            self._set_global_columns(h, layout, start, start + self.num_global_blocks)
        if full_end < num_blocks:
            start = min(full_end + offset, num_blocks - self.num_global_blocks)
            self._set_global_columns(h, layout, start, start + self.num_global_blocks)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """Local windows, then global blocks, per layout head."""
        return self._build(seq_len, self.set_local_layout, self.set_global_layout)


def _global_windows(starts: Sequence[int], ends: Sequence[int] | None, num_blocks: int) -> list[tuple[int, int]]:
    """The [start, stop) block ranges of the global windows that begin inside the sequence."""
    if ends is None:
        return [(idx, idx + 1) for idx in starts if idx < num_blocks]
    return [(start, min(end, num_blocks)) for start, end in zip(starts, ends) if start < num_blocks]


class VariableSparsityConfig(SparsityConfig):
    """Fixed, generalised: random blocks, a list of local window sizes, explicit global blocks.

    ``local_window_blocks`` gives the sizes of the first windows; the last size repeats to the end.
    ``global_block_indices`` (with ``global_block_end_indices``: [start, end) windows) are global
    columns; with ``horizontal_global_attention`` also global rows. Random blocks are drawn from
    the whole row even for unidirectional attention, as in DeepSpeed.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_windows(global_block_indices, global_block_end_indices)
        _check_direction(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        if not local_window_blocks:
            raise ValueError("local_window_blocks must name at least one window size")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """``num_random_blocks`` distinct random columns per row (``random.sample`` over the row)."""
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            layout[h, row, random.sample(range(num_blocks), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The listed windows in order, then windows of the last listed size to the end."""
        num_blocks = layout.shape[1]
        unidirectional = self.attention == "unidirectional"
        start = stop = 0
        for size in self.local_window_blocks:
            stop = min(stop + size, num_blocks)
            _set_window(layout, h, start, stop, unidirectional)
            start += size
        size = self.local_window_blocks[-1]
        for window_start in range(start, num_blocks, size):
            _set_window(layout, h, window_start, min(window_start + size, num_blocks), unidirectional)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Global columns (from their own row on if unidirectional); global rows if horizontal."""
        num_blocks = layout.shape[1]
        for start, stop in _global_windows(self.global_block_indices, self.global_block_end_indices, num_blocks):
            if self.horizontal_global_attention:
                layout[h, start:stop, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:stop] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """Random, then local, then global blocks, per layout head."""
        return self._build(seq_len, self.set_random_layout, self.set_local_layout, self.set_global_layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al., 2020), block-sparse: random blocks, a sliding window, global blocks.

    The first ``num_global_blocks`` blocks attend to everything and are attended by everything.
    Unidirectional draws each row's random blocks from the blocks up to the row and keeps the lower
    triangle of the layout.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_direction(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """``num_random_blocks`` distinct random columns per row, among earlier ones if unidirectional."""
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            population = range(num_blocks) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, random.sample(population, self.num_random_blocks)] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """A window of ``num_sliding_window_blocks`` blocks centred on the diagonal."""
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The first ``num_global_blocks`` rows and columns ("internal transformer construction")."""
        _check_fits("num_global_blocks", self.num_global_blocks, layout.shape[1])
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """Random, then sliding window, then global blocks, per layout head."""
        return self._build(seq_len, self.set_random_layout, self.set_sliding_window_layout, self.set_global_layout_itc)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al., 2020): a sliding window plus global blocks.

    Each global block (or [start, end) window with ``global_block_end_indices``) is both a global row
    and a global column; unidirectional keeps the lower triangle.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_windows(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """A window of ``num_sliding_window_blocks`` blocks centred on the diagonal."""
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Global rows and columns."""
        num_blocks = layout.shape[1]
        for start, stop in _global_windows(self.global_block_indices, self.global_block_end_indices, num_blocks):
            layout[h, start:stop, :] = 1
            layout[h, :, start:stop] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """Sliding window, then global blocks, per layout head."""
        return self._build(seq_len, self.set_sliding_window_layout, self.set_global_layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window: unidirectional (the default) sees the ``num_sliding_window_blocks // 2``
    previous blocks and its own; bidirectional also as many following blocks. One layout for all heads."""

    def __init__(
        self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3, attention: str = "unidirectional"
    ):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The window; backward-only unless bidirectional."""
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, backward_only=self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """Sliding window per layout head."""
        return self._build(seq_len, self.set_sliding_window_layout)


# --- the "sparse_attention" config block -> a SparsityConfig ----------------------------------------

# Which keys of the block each mode reads (DeepSpeed's runtime/config.py get_sparse_*_config), with
# `attention` added to bigbird and bslongformer, whose classes take it (DeepSpeed's dict drops it).
_MODE_KEYS: dict[str, tuple[type[SparsityConfig], tuple[str, ...]]] = {
    "dense": (DenseSparsityConfig, ("block",)),
    "fixed": (
        FixedSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_local_blocks",
            "num_global_blocks",
            "attention",
            "horizontal_global_attention",
            "num_different_global_patterns",
        ),
    ),
    "variable": (
        VariableSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "local_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
            "horizontal_global_attention",
        ),
    ),
    "bigbird": (
        BigBirdSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "num_sliding_window_blocks",
            "num_global_blocks",
            "attention",
        ),
    ),
    "bslongformer": (
        BSLongformerSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_sliding_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
        ),
    ),
}


def build_sparsity_config(sparse_attention: Any, num_heads: int) -> SparsityConfig:
    """The SparsityConfig a ``"sparse_attention"`` config block describes, for ``num_heads`` heads.

    ``sparse_attention`` is the parsed block (``cfg.sparse_attention`` of ``parse_config``) or the raw
    JSON dict, which is validated here with DeepSpeed's defaults (e.g. ``num_random_blocks`` is 0 in the
    config although ``BigBirdSparsityConfig`` defaults to 1, as in DeepSpeed).
    """
    if isinstance(sparse_attention, Mapping):
        sparse_attention = SparseAttentionConfig.model_validate(dict(sparse_attention))
    if not isinstance(sparse_attention, SparseAttentionConfig):
        raise TypeError(
            f"expected the sparse_attention config block (a dict or SparseAttentionConfig), "
            f"got {type(sparse_attention).__name__}"
        )
    cls, keys = _MODE_KEYS[sparse_attention.mode]
    return cls(num_heads, **{key: getattr(sparse_attention, key) for key in keys})


__all__ = [
    "SparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "VariableSparsityConfig",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "build_sparsity_config",
]
