"""Exact values of the ZeRO partition math: buckets, padding, chunks, rank segments, sub-groups, memory."""

import pytest

from zerospeed.zero.memory import model_state_bytes
from zerospeed.zero.partition import Segment, build_layouts, group_sub_groups, padded_size


def test_padded_size_rounds_up_to_world_times_align():
    assert padded_size(10, 2, 4) == 16
    assert padded_size(16, 2, 4) == 16
    assert padded_size(17, 2, 4) == 24
    assert padded_size(0, 4, 4) == 16  # at least one row of chunks
    assert padded_size(5, 3, 1) == 6


def test_buckets_never_split_parameters():
    buckets = build_layouts([6, 5, 20, 3], bucket_size=12, world_size=2, align=1)
    assert [(b.numel, b.padded, b.chunk) for b in buckets] == [(11, 12, 6), (20, 20, 10), (3, 4, 2)]
    assert buckets[0].segments == (Segment(0, 0, 0, 6), Segment(1, 0, 6, 5))
    assert buckets[1].segments == (Segment(2, 0, 0, 20),)


def test_rank_segments_cover_each_parameter_exactly_once():
    numels = [7, 5, 9, 2, 11]
    for world in (1, 2, 3, 4):
        buckets = build_layouts(numels, bucket_size=10, world_size=world, align=2)
        covered = {i: [] for i in range(len(numels))}
        for b in buckets:
            for r in range(world):
                for s in b.rank_segments(r):
                    assert 0 <= s.offset and s.offset + s.numel <= b.chunk
                    covered[s.param].append((s.param_offset, s.numel))
        for i, n in enumerate(numels):
            pieces = sorted(covered[i])
            assert sum(k for _, k in pieces) == n
            assert all(a + k == b for (a, k), (b, _) in zip(pieces, pieces[1:]))


def test_rank_segments_exact_split():
    (b,) = build_layouts([3, 6], bucket_size=100, world_size=2, align=1)
    assert b.padded == 10 and b.chunk == 5
    assert b.rank_segments(0) == [Segment(0, 0, 0, 3), Segment(1, 0, 3, 2)]
    assert b.rank_segments(1) == [Segment(1, 2, 0, 4)]  # last element of the chunk is padding


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="bucket_size must be positive"):
        build_layouts([1], 0, 2)
    with pytest.raises(ValueError, match="world_size must be positive"):
        build_layouts([1], 4, 0)
    with pytest.raises(ValueError, match="sub_group_size must be positive"):
        group_sub_groups([1], 0)


def test_sub_groups_bound_elements():
    assert group_sub_groups([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert group_sub_groups([4, 4, 4], 100) == [[0, 1, 2]]


def test_zero_paper_bytes_per_parameter():
    # mixed-precision Adam: 2 + 2 + 12 bytes; the ZeRO paper's 16, 4 + 12/N, 2 + 14/N
    kw = dict(param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8)
    assert sum(model_state_bytes(1, 64, 0, **kw).values()) == 16
    assert sum(model_state_bytes(1, 64, 1, **kw).values()) == 4 + 12 / 64
    assert sum(model_state_bytes(1, 64, 2, **kw).values()) == 2 + 14 / 64
    # 7.5B parameters on 64 devices (the paper's example), in GB (1e9): 120, 31.4, 16.6
    p = 7.5e9
    assert sum(model_state_bytes(p, 64, 0, **kw).values()) / 1e9 == 120.0
    assert round(sum(model_state_bytes(p, 64, 1, **kw).values()) / 1e9, 1) == 31.4
    assert round(sum(model_state_bytes(p, 64, 2, **kw).values()) / 1e9, 1) == 16.6


def _groups(numels, size):
    return [[seg.param for seg in layout.segments] for layout in build_layouts(numels, size, world_size=1)]


def test_layouts_keep_order_and_cap_size():
    # the grouping every stage's gradient units use (stage 0: world_size 1, no chunks)
    assert _groups([3, 4, 10, 1, 1], 6) == [[0], [1], [2], [3, 4]]
    assert _groups([2, 2, 2], 6) == [[0, 1, 2]]
    assert _groups([2, 2, 2], 4) == [[0, 1], [2]]
    assert _groups([], 4) == []
    assert _groups([1, 100, 1], 10) == [[0], [1], [2]]  # an oversized parameter gets its own layout
