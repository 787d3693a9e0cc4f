"""Pure layout math of Ulysses (head splits, kv replication, padding, sharding) against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from zerospeed.sequence.data import shard_sequence_batch, shift_labels_of
from zerospeed.sequence.layout import HeadPlan, head_split, kv_heads_for, padded_length, shard_range


def test_head_split_is_even_with_the_remainder_first():
    assert head_split(8, 4) == [2, 2, 2, 2]
    assert head_split(7, 4) == [2, 2, 2, 1]
    assert head_split(6, 4) == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="sequence_parallel_size <= 3"):
        head_split(3, 4)


def test_kv_heads_follow_the_query_heads_they_serve():
    # MHA: the same heads
    assert HeadPlan.of(4, 4, 2).kv == ((0, 1), (2, 3))
    # GQA 8 q / 2 kv over 4 ranks: q heads 0-1 and 2-3 read kv 0, 4-5 and 6-7 read kv 1 (kv replicated 2x)
    plan = HeadPlan.of(8, 2, 4)
    assert plan.q == ((0, 1), (2, 3), (4, 5), (6, 7)) and plan.kv == ((0,), (0,), (1,), (1,))
    assert [plan.kv_groups(r) for r in range(4)] == [2, 2, 2, 2]
    # MQA: the single kv head goes everywhere
    assert HeadPlan.of(4, 1, 4).kv == ((0,), (0,), (0,), (0,))
    # 6 q / 3 kv (groups of 2) split 2/2/1/1: every block reads uniformly
    assert HeadPlan.of(6, 3, 4).kv == ((0,), (1,), (2,), (2,))
    # 6 q / 2 kv (groups of 3) split 2/2/1/1: rank 1 holds q 2 (kv 0) and q 3 (kv 1) — one kv per q head
    assert kv_heads_for([2, 3], 6, 2) == [0, 1]
    # a non-uniform block: q 1, 2, 3 with groups of 3 read kv 0, 0, 1 -> one kv head per query head
    assert kv_heads_for([1, 2, 3], 6, 2) == [0, 0, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        kv_heads_for([0], 6, 4)


def test_padding_and_shard_ranges():
    assert padded_length(13, 4) == 16 and padded_length(16, 4) == 16 and padded_length(1, 2) == 2
    assert [shard_range(13, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_shard_sequence_batch_shifts_before_sharding_and_pads_at_the_end():
    ids = torch.arange(1, 6).unsqueeze(0)  # [[1, 2, 3, 4, 5]]
    labels = torch.tensor([[1, -100, 3, 4, 5]])
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "n": 7}
    shards = [shard_sequence_batch(batch, r, 2, pad_token_id=9) for r in range(2)]
    assert shards[0]["input_ids"].tolist() == [[1, 2, 3]] and shards[1]["input_ids"].tolist() == [[4, 5, 9]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 2]] and shards[1]["position_ids"].tolist() == [[3, 4, 5]]
    # the target of position 2 (token 3) is token 4, which lives on rank 1: shifting first keeps it
    assert shards[0]["shift_labels"].tolist() == [[-100, 3, 4]]
    assert shards[1]["shift_labels"].tolist() == [[5, -100, -100]]
    assert shards[1]["labels"].tolist() == [[4, 5, -100]]
    assert "attention_mask" not in shards[0] and shards[0]["n"] == 7
    assert shift_labels_of(labels).tolist() == [[-100, 3, 4, 5, -100]]
