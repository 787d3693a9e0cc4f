"""Block-allocation math of the paged KV cache: pure integers, no tensors.

The cache is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence owns a block table
(a list of block ids); its token at position p lives in slot `table[p // block_size] * block_size +
p % block_size`. A sequence of n tokens holds ceil(n / block_size) blocks, so at most block_size - 1
slots of its last block are allocated but empty — the only waste (no per-sequence reservation of the
maximum length, which is what a contiguous cache wastes). Finished sequences give their blocks back to
the free list at once, and the next request can take them between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_needed(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` token slots."""
    if block_size < 1 or tokens < 0:
        raise ValueError(f"blocks_needed(tokens={tokens}, block_size={block_size}): need tokens >= 0, block_size >= 1")
    return -(-tokens // block_size)


def slot(table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of the token at `position` of a sequence with block table `table`."""
    return table[position // block_size] * block_size + position % block_size


def slots(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The slots of positions [start, stop)."""
    return [slot(table, p, block_size) for p in range(start, stop)]


def wasted_slots(lengths: list[int], block_size: int) -> int:
    """Allocated but empty slots when sequences of these lengths each hold just enough blocks."""
    return sum(blocks_needed(n, block_size) * block_size - n for n in lengths)


class OutOfBlocks(RuntimeError):
    """The free list cannot satisfy an allocation (the scheduler preempts or waits instead)."""


@dataclass
class BlockAllocator:
    """A free list of block ids 0..num_blocks-1; the lowest ids go out first (deterministic layouts)."""

    num_blocks: int
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"BlockAllocator(num_blocks={self.num_blocks}): need at least one block")
        self.free = list(range(self.num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self.free)} free of {self.num_blocks}")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        held = set(self.free)
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in held:
                raise ValueError(f"block {b} released twice or not from this allocator")
            held.add(b)
        self.free.extend(sorted(blocks, reverse=True))
        self.free.sort(reverse=True)


def grow(table: list[int], tokens: int, block_size: int, allocator: BlockAllocator) -> list[int]:
    """Extend `table` in place to hold `tokens` tokens; returns the newly allocated block ids."""
    extra = blocks_needed(tokens, block_size) - len(table)
    if extra <= 0:
        return []
    new = allocator.allocate(extra)
    table.extend(new)
    return new
