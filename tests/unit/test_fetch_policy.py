"""The pure stage-3 fetch policy: prefetch choices and reuse decisions, exact values, no processes."""

from __future__ import annotations

from zerospeed.zero.stage3.fetch_policy import FetchSchedule

SIZES = [10, 20, 30, 40]  # padded elements of units 0..3


def recorded(order, **kw) -> FetchSchedule:
    s = FetchSchedule(SIZES, **{"prefetch_budget": 1000, "max_live": 1000, "max_reuse_distance": 1000, **kw})
    s.start_micro_step()
    for u in order:
        s.record(u)
    s.start_micro_step()  # the recording becomes the order to prefetch by
    return s


def test_first_micro_step_prefetches_nothing():
    s = FetchSchedule(SIZES, prefetch_budget=1000, max_live=1000, max_reuse_distance=1000)
    s.start_micro_step()
    s.record(0)
    assert s.to_prefetch(lambda i: True, 0, 0) == []


def test_prefetch_follows_the_recorded_order_within_the_budget():
    s = recorded([0, 1, 2, 3], prefetch_budget=55)
    s.record(0)
    # window: 20 (unit 1) + 30 (unit 2) = 50 <= 55; adding unit 3 (40) would look past the budget
    assert s.to_prefetch(lambda i: True, 0, 0) == [1, 2]
    # what is already gathered still counts in the window but is not gathered again
    assert s.to_prefetch(lambda i: i != 1, 0, 0) == [2]
    # elements already in flight count against the budget: 20 + 30 > 40
    assert s.to_prefetch(lambda i: True, 40, 0) == []
    assert s.to_prefetch(lambda i: True, 30, 0) == [1]


def test_prefetch_respects_max_live_and_repeated_units_once():
    s = recorded([0, 1, 1, 2], max_live=65)
    s.record(0)
    assert s.to_prefetch(lambda i: True, 0, 10) == [1, 2]  # 10 live + 20 + 30 = 60 <= 65
    assert s.to_prefetch(lambda i: True, 0, 20) == [1]  # 20 + 20 + 30 = 70 > 65


def test_an_order_change_stops_prefetching_for_the_micro_step_and_replaces_the_recording():
    s = recorded([0, 1, 2])
    s.record(0)
    s.record(2)  # expected 1
    assert not s.prefetching and s.to_prefetch(lambda i: True, 0, 0) == []
    s.record(1)
    s.start_micro_step()
    assert s.recorded == [0, 2, 1] and s.prefetching


def test_reuse_distance_keeps_a_unit_only_when_its_next_use_is_near():
    # forward 0 1 2 3, backward 3 2 1 0: unit 3 is used again at once, unit 0 after 100 elements
    order = [0, 1, 2, 3, 3, 2, 1, 0]
    s = recorded(order, max_reuse_distance=50)
    for u in order[:4]:
        s.record(u)
    assert s.keep_after_use(3, live=0)  # nothing gathered between its two uses
    assert not s.keep_after_use(2, live=0)  # unit 3's two uses (80 elements) lie before its next one
    assert not s.keep_after_use(0, live=0)  # 20 + 30 + 40 + 40 + 30 + 20 elements in between
    assert not s.keep_after_use(3, live=2000)  # over max_live: released whatever the distance
    s.record(3)
    assert not s.keep_after_use(3, live=0)  # its last use: nothing ahead


def test_reuse_distance_zero_frees_everything_but_back_to_back_uses():
    order = [0, 1, 1, 0]
    s = recorded(order, max_reuse_distance=0)
    s.record(0)
    s.record(1)
    assert s.keep_after_use(1, live=0)  # the next use follows directly: 0 elements in between
    assert not s.keep_after_use(0, live=0)
