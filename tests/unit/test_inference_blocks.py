"""Paged KV cache bookkeeping without tensors: block math, the allocator, the continuous-batching scheduler."""

from __future__ import annotations

import pytest

from zerospeed.inference.paged.blocks import BlockAllocator, OutOfBlocks, blocks_needed, grow, slot, slots, wasted_slots
from zerospeed.inference.paged.scheduler import Scheduler, Sequence


def test_block_math():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    table = [7, 2, 5]
    assert [slot(table, p, 4) for p in (0, 3, 4, 9)] == [28, 31, 8, 21]
    assert slots(table, 3, 6, 4) == [31, 8, 9]
    assert wasted_slots([1, 4, 5, 8, 9], 4) == 3 + 0 + 3 + 0 + 3
    with pytest.raises(ValueError):
        blocks_needed(3, 0)


def test_allocator_lowest_first_and_reuse():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(1) == [2]
    a.release([0, 1])
    assert a.num_free == 3 and a.allocate(3) == [0, 1, 3]
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    with pytest.raises(ValueError, match="twice"):
        a.release([2, 2])


def test_grow_allocates_only_when_a_block_fills():
    a, table = BlockAllocator(8), []
    assert grow(table, 3, 4, a) == [0]
    assert grow(table, 4, 4, a) == []
    assert grow(table, 5, 4, a) == [1] and table == [0, 1]


def _seq(rid, prompt, new):
    return Sequence(rid, list(range(1, prompt + 1)), prompt, new)


def _run_step(s: Scheduler, token=9):
    work = s.schedule()
    return work, s.complete(work, [token] * len(work))


def test_prefill_then_decode_and_blocks_freed_on_finish():
    s = Scheduler(BlockAllocator(8), 4)
    s.add(_seq(0, 5, 2))
    work, done = _run_step(s)
    assert [(w.start, w.stop) for w in work] == [(0, 5)] and work[0].new_slots == [0, 1, 2, 3, 4]
    work, done = _run_step(s)
    assert [(w.start, w.stop) for w in work] == [(5, 6)] and work[0].context_slots == [0, 1, 2, 3, 4, 5]
    assert [q.request_id for q in done] == [0] and s.allocator.num_free == 8 and not s.has_work()


def test_new_request_joins_between_steps():
    s = Scheduler(BlockAllocator(16), 4)
    s.add(_seq(0, 3, 5))
    _run_step(s)
    s.add(_seq(1, 6, 5))
    work, _ = _run_step(s)
    assert [(w.seq.request_id, w.start, w.stop) for w in work] == [(0, 3, 4), (1, 0, 6)]


def test_admission_waits_for_blocks_and_token_budget():
    s = Scheduler(BlockAllocator(3), 4, max_batch_tokens=8)
    s.add(_seq(0, 6, 1))
    s.add(_seq(1, 5, 1))  # 6 + 5 > 8 tokens: waits a step
    work, _ = _run_step(s)
    assert [w.seq.request_id for w in work] == [0]
    work, _ = _run_step(s)
    assert [w.seq.request_id for w in work] == [1]


def test_preemption_recomputes_the_newest_sequence():
    s = Scheduler(BlockAllocator(3), 4)
    s.add(_seq(0, 4, 6))
    s.add(_seq(1, 4, 6))
    _run_step(s)  # both prefilled: 2 blocks used, 1 free; both need a 2nd block for their next token
    work, _ = _run_step(s)
    assert s.preemptions == 1 and [w.seq.request_id for w in work] == [0]
    assert s.waiting[0].request_id == 1 and s.waiting[0].computed == 0 and s.waiting[0].table == []
    while s.has_work():
        _run_step(s)
    assert s.allocator.num_free == 3


def test_request_too_large_for_the_cache_is_refused():
    s = Scheduler(BlockAllocator(2), 4)
    with pytest.raises(ValueError, match="raise num_blocks"):
        s.add(_seq(0, 6, 3))
