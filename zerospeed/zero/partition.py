"""Pure partition math for ZeRO: flat layouts, padding, each rank's chunk, sub-groups.

Vocabulary (one word per concept): a *flat layout* (`FlatLayout`) is whole parameters laid end to
end in one padded flat buffer, cut into `world_size` equal *chunks*; a *reduction bucket* is what one
gradient collective carries (`zero/reducer.py`); a *sub-group* is what one optimizer step covers.

Note [flat-layout partition]: a parameter group's trainable parameters are laid end to end in flat
layouts of about `reduce_bucket_size` elements (a parameter is never split; one larger than that
gets a layout of its own). Each layout is padded to a multiple of world_size * ALIGN and divided into
world_size equal chunks; rank r owns chunk r of *every* layout. So each layout's gradient reduction
is one balanced reduce-scatter and each layout's parameter refresh one balanced all-gather, issued
as soon as that layout is ready, with no per-rank reduce calls. DeepSpeed instead cuts the whole
flat group into N contiguous slices, so a bucket straddles ranks unevenly and is reduced with one
`reduce` per owning rank; the two layouts hold the same 1/N of every state on each rank. The map
between a rank's chunks and parameter elements is pure (`FlatLayout.rank_segments`), which is what
checkpoints use to consolidate or reshard.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4  # chunk sizes are multiples of 4 elements (16 bytes in fp32) for aligned collectives


@dataclass(frozen=True)
class Segment:
    """Elements [param_offset, param_offset + numel) of parameter `param` at `offset` in a container."""

    param: int
    param_offset: int
    offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    index: int
    segments: tuple[Segment, ...]  # whole parameters, offsets within the layout
    numel: int  # unpadded
    padded: int  # multiple of world_size * ALIGN
    world_size: int

    @property
    def chunk(self) -> int:
        """Elements each rank owns in this layout."""
        return self.padded // self.world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        return rank * self.chunk, (rank + 1) * self.chunk

    def rank_segments(self, rank: int) -> list[Segment]:
        """The parameter pieces inside rank's chunk, offsets relative to the chunk start."""
        lo, hi = self.chunk_range(rank)
        out = []
        for s in self.segments:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(Segment(s.param, s.param_offset + a - s.offset, a - lo, b - a))
        return out


def padded_size(numel: int, world_size: int, align: int = ALIGN) -> int:
    """`numel` rounded up to a multiple of world_size * align (at least one full row of chunks)."""
    unit = world_size * align
    return max(unit, -(-numel // unit) * unit)


def build_layouts(
    numels: list[int], bucket_size: int, world_size: int, align: int = ALIGN, kinds: list | None = None
) -> list[FlatLayout]:
    """Lay parameters (in the given order) into padded flat layouts of about `bucket_size` elements.

    With `kinds` (one hashable per parameter), a layout also ends where the kind changes, so each holds
    one kind (the dtype its gradients travel in: Note [autocast gradient communication])."""
    if kinds is not None and len(kinds) != len(numels):
        raise ValueError(f"kinds has {len(kinds)} entries for {len(numels)} parameters")
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    layouts: list[FlatLayout] = []
    current: list[Segment] = []
    filled = 0

    def close():
        nonlocal current, filled
        layouts.append(
            FlatLayout(len(layouts), tuple(current), filled, padded_size(filled, world_size, align), world_size)
        )
        current, filled = [], 0

    for i, numel in enumerate(numels):
        if current and (filled + numel > bucket_size or (kinds is not None and kinds[i] != kinds[i - 1])):
            close()
        current.append(Segment(i, 0, filled, numel))
        filled += numel
    if current:
        close()
    return layouts


def group_sub_groups(sizes: list[int], sub_group_size: int) -> list[list[int]]:
    """Consecutive chunk indices grouped so each group holds at most `sub_group_size` elements
    (a chunk larger than that is a group of its own)."""
    if sub_group_size <= 0:
        raise ValueError(f"sub_group_size must be positive, got {sub_group_size}")
    groups: list[list[int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        if groups and filled + n <= sub_group_size:
            groups[-1].append(i)
            filled += n
        else:
            groups.append([i])
            filled = n
    return groups
