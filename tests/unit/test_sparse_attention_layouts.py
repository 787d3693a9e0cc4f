"""Sparsity layouts: each config's make_layout equals the layout DeepSpeed's rules give.

The expected layouts below are written by hand from DeepSpeed's rules (deepspeed/ops/sparse_attention/
sparsity_config.py), one row of blocks per line, not produced by the code under test. Random blocks
are derived in the test by replaying DeepSpeed's calls to Python's `random.sample` (one per block
row, heads in order), so the same seed must give the same layout and leave `random` in the same state.
"""

from __future__ import annotations

import random

import pytest
import torch

from zerospeed.config import parse_config
from zerospeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
    build_sparsity_config,
)

BLOCK = 2


def grid(text: str) -> torch.Tensor:
    """'1101 / 0110' -> a [blocks, blocks] int64 tensor."""
    rows = [[int(c) for c in row] for row in text.split()]
    return torch.tensor(rows, dtype=torch.int64)


def heads(*layouts: str) -> torch.Tensor:
    return torch.stack([grid(layout) for layout in layouts])


# (config, expected [heads, blocks, blocks]); seq_len = blocks * BLOCK.
CASES = {
    "dense": (DenseSparsityConfig(2, block=BLOCK), heads("111 111 111", "111 111 111")),
    # windows of 4; block 3 of each window (the last) is global for every row.
    "fixed_bidirectional": (
        FixedSparsityConfig(1, block=BLOCK),
        heads("11110001 11110001 11110001 11110001 00011111 00011111 00011111 00011111"),
    ),
    # causal inside each window; global column i only from row i on.
    "fixed_unidirectional": (
        FixedSparsityConfig(1, block=BLOCK, attention="unidirectional"),
        heads("10000000 11000000 11100000 11110000 00011000 00011100 00011110 00011111"),
    ),
    # windows of 2 over 5 blocks: [0,1] [2,3] [4]; globals 1, 3 and (short last window) 4, also as rows.
    "fixed_horizontal_short_last_window": (
        FixedSparsityConfig(1, block=BLOCK, num_local_blocks=2, horizontal_global_attention=True),
        heads("11011 11111 01111 11111 11111"),
    ),
    # per-head global patterns: heads 0 and 2 use the last block of each window, head 1 the first.
    "fixed_patterns_per_head": (
        FixedSparsityConfig(
            3, block=BLOCK, different_layout_per_head=True, num_local_blocks=2, num_different_global_patterns=2
        ),
        heads("1101 1101 0111 0111", "1110 1110 1011 1011", "1101 1101 0111 0111"),
    ),
    # two global blocks per window of 4; the window's last two blocks.
    "fixed_two_global_blocks": (
        FixedSparsityConfig(1, block=BLOCK, num_local_blocks=4, num_global_blocks=2),
        heads("11110011 11110011 11110011 11110011 00111111 00111111 00111111 00111111"),
    ),
    # windows 1, 2, then 2 repeated: [0] [1,2] [3,4] [5]; global column 0.
    "variable_windows": (
        VariableSparsityConfig(1, block=BLOCK, local_window_blocks=[1, 2]),
        heads("100000 111000 111000 100110 100110 100001"),
    ),
    # a global window [1, 3), unidirectional: columns 1-2 from row 1 on; causal windows of 2.
    "variable_global_window_unidirectional": (
        VariableSparsityConfig(
            1,
            block=BLOCK,
            local_window_blocks=[2],
            global_block_indices=[1],
            global_block_end_indices=[3],
            attention="unidirectional",
        ),
        heads("100000 111000 011000 011100 011010 011011"),
    ),
    # horizontal: global block 2 is also a full row; windows [0,4) and [4,6).
    "variable_horizontal": (
        VariableSparsityConfig(
            1, block=BLOCK, local_window_blocks=[4], global_block_indices=[2], horizontal_global_attention=True
        ),
        heads("111100 111100 111111 111100 001011 001011"),
    ),
    # no random blocks: window of 3 around the diagonal plus row 0 and column 0.
    "bigbird_no_random": (
        BigBirdSparsityConfig(2, block=BLOCK, num_random_blocks=0),
        heads("111111 111000 111100 101110 100111 100011", "111111 111000 111100 101110 100111 100011"),
    ),
    # window of 5, two global blocks, lower triangle kept.
    "bigbird_unidirectional": (
        BigBirdSparsityConfig(
            1,
            block=BLOCK,
            num_random_blocks=0,
            num_sliding_window_blocks=5,
            num_global_blocks=2,
            attention="unidirectional",
        ),
        heads("100000 110000 111000 111100 111110 110111"),
    ),
    "bslongformer": (BSLongformerSparsityConfig(1, block=BLOCK), heads("11111 11100 11110 10111 10011")),
    # global windows [1,2) and [3,5) are rows and columns; then the lower triangle.
    "bslongformer_windows_unidirectional": (
        BSLongformerSparsityConfig(
            1, block=BLOCK, global_block_indices=[1, 3], global_block_end_indices=[2, 5], attention="unidirectional"
        ),
        heads("10000 11000 01100 11110 11111"),
    ),
    "local_sliding_window": (
        LocalSlidingWindowSparsityConfig(2, block=BLOCK),
        heads("10000 11000 01100 00110 00011", "10000 11000 01100 00110 00011"),
    ),
    "local_sliding_window_bidirectional": (
        LocalSlidingWindowSparsityConfig(1, block=BLOCK, num_sliding_window_blocks=5, attention="bidirectional"),
        heads("11100 11110 11111 01111 00111"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_matches_deepspeed_rules(name):
    config, expected = CASES[name]
    layout = config.make_layout(expected.shape[1] * BLOCK)
    assert layout.dtype == torch.int64
    assert torch.equal(layout, expected), f"{name}:\n{layout}"


def _with_random(
    deterministic: torch.Tensor, seed: int, num_random: int, layout_heads: int, population
) -> torch.Tensor:
    """Replay DeepSpeed's draws: for each layout head, for each row, random.sample(population(row), k)."""
    expected = deterministic.clone()
    rng = random.Random(seed)
    for head in range(layout_heads):
        for row in range(expected.shape[1]):
            expected[head, row, rng.sample(population(row), num_random)] = 1
    return expected, rng.random()


def test_variable_random_blocks_follow_random_sample_per_head():
    blocks = 6
    diag_and_column0 = grid("100000 110000 101000 100100 100010 100001")
    random.seed(7)
    layout = VariableSparsityConfig(
        2, block=BLOCK, different_layout_per_head=True, num_random_blocks=2, local_window_blocks=[1]
    ).make_layout(blocks * BLOCK)
    after = random.random()
    expected, replay_after = _with_random(torch.stack([diag_and_column0] * 2), 7, 2, 2, lambda row: range(blocks))
    assert torch.equal(layout, expected) and after == replay_after
    assert not torch.equal(layout[0], layout[1])  # each head drew its own blocks


def test_variable_random_blocks_ignore_direction_like_deepspeed():
    # DeepSpeed's Variable draws from the whole row even when unidirectional.
    blocks = 5
    causal_diag = grid("10000 11000 10100 10010 10001")
    random.seed(3)
    layout = VariableSparsityConfig(
        1, block=BLOCK, num_random_blocks=1, local_window_blocks=[1], attention="unidirectional"
    ).make_layout(blocks * BLOCK)
    expected, _ = _with_random(causal_diag[None], 3, 1, 1, lambda row: range(blocks))
    assert torch.equal(layout, expected)


def test_bigbird_random_blocks_one_layout_for_all_heads():
    blocks = 6
    base = grid("111111 111000 111100 101110 100111 100011")
    random.seed(11)
    layout = BigBirdSparsityConfig(3, block=BLOCK, num_random_blocks=2).make_layout(blocks * BLOCK)
    after = random.random()
    expected, replay_after = _with_random(base[None], 11, 2, 1, lambda row: range(blocks))
    assert torch.equal(layout, expected.expand(3, -1, -1)) and after == replay_after


def test_bigbird_unidirectional_random_blocks_come_from_earlier_blocks():
    blocks = 6
    base = grid("100000 110000 011000 001100 000110 000011") | grid("100000 100000 100000 100000 100000 100000")
    random.seed(5)
    layout = BigBirdSparsityConfig(1, block=BLOCK, num_random_blocks=1, attention="unidirectional").make_layout(
        blocks * BLOCK
    )
    expected, _ = _with_random(base[None], 5, 1, 1, lambda row: range(row + 1))
    assert torch.equal(layout, expected.tril())


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: FixedSparsityConfig(4, num_local_blocks=4, num_global_blocks=3), ValueError),
        (lambda: FixedSparsityConfig(4, attention="sideways"), NotImplementedError),
        (lambda: FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True), ValueError),
        (lambda: FixedSparsityConfig(4, num_different_global_patterns=2), ValueError),
        (
            lambda: FixedSparsityConfig(
                4,
                different_layout_per_head=True,
                num_local_blocks=4,
                num_global_blocks=2,
                num_different_global_patterns=3,
            ),
            ValueError,
        ),
        (lambda: VariableSparsityConfig(4, global_block_indices=[0, 4], global_block_end_indices=[2]), ValueError),
        (lambda: VariableSparsityConfig(4, global_block_indices=[3], global_block_end_indices=[3]), ValueError),
        (lambda: VariableSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True), ValueError),
        (lambda: BSLongformerSparsityConfig(4, global_block_indices=[2], global_block_end_indices=[1]), ValueError),
        (lambda: BigBirdSparsityConfig(4, attention="sideways"), NotImplementedError),
    ],
)
def test_invalid_arguments_raise_like_deepspeed(make, error):
    with pytest.raises(error):
        make()


@pytest.mark.parametrize(
    "config, seq_len",
    [
        (FixedSparsityConfig(2, block=16), 40),  # not a multiple of the block
        (BigBirdSparsityConfig(2, block=16, num_random_blocks=3), 32),  # more random blocks than blocks
        (BigBirdSparsityConfig(2, block=16, num_sliding_window_blocks=3), 32),
        (BigBirdSparsityConfig(2, block=16, num_random_blocks=0, num_global_blocks=3), 32),
        (BSLongformerSparsityConfig(2, block=16, num_sliding_window_blocks=5), 64),
        (LocalSlidingWindowSparsityConfig(2, block=16, num_sliding_window_blocks=5), 64),
    ],
)
def test_layouts_that_do_not_fit_the_sequence_raise(config, seq_len):
    with pytest.raises(ValueError):
        config.make_layout(seq_len)


def test_deepspeed_defaults():
    fixed = FixedSparsityConfig(8)
    assert (
        fixed.block,
        fixed.different_layout_per_head,
        fixed.num_local_blocks,
        fixed.num_global_blocks,
        fixed.attention,
        fixed.horizontal_global_attention,
        fixed.num_different_global_patterns,
    ) == (16, False, 4, 1, "bidirectional", False, 1)
    variable = VariableSparsityConfig(8)
    assert (
        variable.num_random_blocks,
        variable.local_window_blocks,
        variable.global_block_indices,
        variable.global_block_end_indices,
        variable.attention,
    ) == (0, [4], [0], None, "bidirectional")
    bigbird = BigBirdSparsityConfig(8)
    assert (bigbird.num_random_blocks, bigbird.num_sliding_window_blocks, bigbird.num_global_blocks) == (1, 3, 1)
    longformer = BSLongformerSparsityConfig(8)
    assert (longformer.num_sliding_window_blocks, longformer.global_block_indices) == (3, [0])
    local = LocalSlidingWindowSparsityConfig(8)
    assert (local.num_sliding_window_blocks, local.attention, local.num_layout_heads) == (3, "unidirectional", 1)
    assert FixedSparsityConfig(8, different_layout_per_head=True, num_different_global_patterns=2).num_layout_heads == 8
    with pytest.raises(NotImplementedError, match="defines no pattern"):
        SparsityConfig(4).make_layout(64)


# --- the "sparse_attention" config block ---------------------------------------------------------------


@pytest.mark.parametrize(
    "block, cls, attrs",
    [
        ({"mode": "dense", "block": 32}, DenseSparsityConfig, {"block": 32}),
        ({}, FixedSparsityConfig, {"block": 16, "num_local_blocks": 4, "num_global_blocks": 1}),
        (
            {
                "mode": "fixed",
                "num_local_blocks": 8,
                "num_global_blocks": 2,
                "attention": "unidirectional",
                "different_layout_per_head": True,
                "num_different_global_patterns": 4,
            },
            FixedSparsityConfig,
            {
                "num_local_blocks": 8,
                "num_global_blocks": 2,
                "attention": "unidirectional",
                "num_different_global_patterns": 4,
                "num_layout_heads": 12,
            },
        ),
        (
            {
                "mode": "variable",
                "num_random_blocks": 2,
                "local_window_blocks": [2, 4],
                "global_block_indices": [0, 5],
                "global_block_end_indices": [1, 7],
                "horizontal_global_attention": True,
            },
            VariableSparsityConfig,
            {
                "num_random_blocks": 2,
                "local_window_blocks": [2, 4],
                "global_block_end_indices": [1, 7],
                "horizontal_global_attention": True,
            },
        ),
        # the config's num_random_blocks defaults to 0, the class's to 1 (both DeepSpeed's)
        (
            {"mode": "bigbird", "block": 32, "num_sliding_window_blocks": 5},
            BigBirdSparsityConfig,
            {"block": 32, "num_random_blocks": 0, "num_sliding_window_blocks": 5},
        ),
        (
            {"mode": "bslongformer", "global_block_indices": [0, 9]},
            BSLongformerSparsityConfig,
            {"num_sliding_window_blocks": 3, "global_block_indices": [0, 9]},
        ),
    ],
)
def test_config_block_builds_the_sparsity_config(block, cls, attrs):
    cfg = parse_config({"train_batch_size": 1, "sparse_attention": block})  # the feature check passes now
    for source in (cfg.sparse_attention, block):
        config = build_sparsity_config(source, num_heads=12)
        assert type(config) is cls and config.num_heads == 12
        assert {key: getattr(config, key) for key in attrs} == attrs


def test_config_block_errors():
    with pytest.raises(Exception, match="mode"):
        build_sparsity_config({"mode": "sparse"}, num_heads=4)
    with pytest.raises(TypeError):
        build_sparsity_config(42, num_heads=4)


# --- SparseSelfAttention's layout: a corner of the master layout ---------------------------------------


def test_layout_for_a_shorter_sequence_is_the_master_corner():
    random.seed(0)
    attention = SparseSelfAttention(BigBirdSparsityConfig(2, block=16, num_random_blocks=2), max_seq_length=256)
    master = attention.master_layout
    assert master.shape == (2, 16, 16)
    assert torch.equal(attention.get_layout(128), master[:, :8, :8])
    with pytest.raises(ValueError, match="multiple of the block size"):
        attention.get_layout(100)
    with pytest.raises(ValueError, match="max_seq_length"):
        attention.get_layout(512)
    with pytest.raises(ValueError, match="mode"):
        SparseSelfAttention(FixedSparsityConfig(2), key_padding_mask_mode="or")
