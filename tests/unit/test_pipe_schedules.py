"""Pipeline schedules (exact instruction orders) and the matching / deadlock simulator."""

from __future__ import annotations

import pytest

from zerospeed.parallel.pipeline.schedules import BackwardPass as B
from zerospeed.parallel.pipeline.schedules import ForwardPass as F
from zerospeed.parallel.pipeline.schedules import LoadMicroBatch as L
from zerospeed.parallel.pipeline.schedules import (
    OptimizerStep,
    ReduceGrads,
    ReduceTiedGrads,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
    warmup_forwards,
)
from zerospeed.parallel.pipeline.schedules import RecvActivation as RA
from zerospeed.parallel.pipeline.schedules import RecvGrad as RG
from zerospeed.parallel.pipeline.schedules import SendActivation as SA
from zerospeed.parallel.pipeline.schedules import SendGrad as SG
from zerospeed.parallel.pipeline.simulate import ScheduleError, simulate

STEP = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_1f1b_two_stages_three_micro_batches_by_hand():
    # stage 0: one warm-up forward, then forward/backward pairs, then the last backward
    assert list(one_f_one_b(0, 2, 3)) == [
        L(0),
        F(0),
        SA(0),
        L(1),
        F(1),
        SA(1),
        RG(0),
        B(0),
        L(2),
        F(2),
        SA(2),
        RG(1),
        B(1),
        RG(2),
        B(2),
        *STEP,
    ]
    # the last stage loads labels; its receive comes before the load (see Note [where communication sits])
    assert list(one_f_one_b(1, 2, 3)) == [
        RA(0),
        L(0),
        F(0),
        B(0),
        SG(0),
        RA(1),
        L(1),
        F(1),
        B(1),
        SG(1),
        RA(2),
        L(2),
        F(2),
        B(2),
        SG(2),
        *STEP,
    ]


def test_fill_drain_eval_and_train_by_hand():
    assert list(fill_drain(0, 2, 2)) == [L(0), F(0), SA(0), L(1), F(1), SA(1)]
    assert list(fill_drain(1, 2, 2)) == [RA(0), L(0), F(0), RA(1), L(1), F(1)]
    assert list(fill_drain(1, 2, 2, train=True)) == [
        RA(0),
        L(0),
        F(0),
        RA(1),
        L(1),
        F(1),
        B(0),
        SG(0),
        B(1),
        SG(1),
        *STEP,
    ]


def test_interleaved_two_stages_two_chunks_by_hand():
    # m == p: all four chunk-forwards are warm-up; chunk 1 of stage 0 is virtual stage 2
    assert list(interleaved_1f1b(0, 2, 2, 2)) == [
        L(0, 0),
        F(0, 0),
        SA(0, 0),
        L(1, 0),
        F(1, 0),
        SA(1, 0),
        RA(0, 1),
        F(0, 1),
        SA(0, 1),
        RA(1, 1),
        F(1, 1),
        SA(1, 1),
        RG(0, 1),
        B(0, 1),
        SG(0, 1),
        RG(1, 1),
        B(1, 1),
        SG(1, 1),
        RG(0, 0),
        B(0, 0),
        RG(1, 0),
        B(1, 0),
        *STEP,
    ]


def test_interleaved_steady_state_posts_receives_before_and_sends_after_each_pair():
    sched = list(interleaved_1f1b(1, 2, 4, 2))
    # forwards (mb, chunk): (0,0) (1,0) | (0,1) (1,1) (2,0) ...; backwards: (0,1) (1,1) (0,0) ...
    # warm-up 2 forwards; the third pair is F(2, 0) with B(0, 0), both on virtual stage 1
    i = sched.index(F(2, 0))
    assert sched[i - 3 : i + 4] == [SG(1, 1), RA(2, 0), RG(0, 0), F(2, 0), B(0, 0), SA(2, 0), SG(0, 0)]
    # the first pair, on the last virtual stage (3): the label load sits after the receive
    assert sched[:6] == [RA(0, 0), F(0, 0), SA(0, 0), RA(1, 0), F(1, 0), SA(1, 0)]
    assert sched[6:11] == [RA(0, 1), L(0, 1), F(0, 1), B(0, 1), SG(0, 1)]


@pytest.mark.parametrize(
    "stage, stages, m, chunks, expected",
    [
        (0, 4, 8, 1, 3),
        (3, 4, 8, 1, 0),
        (0, 4, 2, 1, 2),
        (0, 2, 4, 2, (2 - 0 - 1) * 2 + (2 - 1) * 2),
        (1, 2, 4, 2, 2),
        (0, 2, 2, 2, 4),
    ],
)
def test_warmup_forwards(stage, stages, m, chunks, expected):
    assert warmup_forwards(stage, stages, m, chunks) == expected


def test_peak_in_flight_1f1b_versus_fill_drain():
    assert [peak_in_flight(list(one_f_one_b(s, 4, 8))) for s in range(4)] == [4, 3, 2, 1]
    assert [peak_in_flight(list(fill_drain(s, 4, 8, train=True))) for s in range(4)] == [8, 8, 8, 8]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(stage=2, stages=2, micro_batches=1), "stage 2 outside a pipeline of 2"),
        (dict(stage=0, stages=0, micro_batches=1), "at least 1 stage"),
        (dict(stage=0, stages=2, micro_batches=0), "at least 1 micro-batch"),
        (dict(stage=0, stages=1, micro_batches=2, chunks=2), "needs at least 2 pipeline stages"),
        (dict(stage=0, stages=2, micro_batches=3, chunks=2), "divisible by the number of stages (2)"),
    ],
)
def test_schedule_argument_errors(kw, message):
    with pytest.raises(ValueError) as err:
        list(one_f_one_b(**kw))
    assert message in str(err.value)


def _all(fn, stages, m, *args, **kw):
    return [list(fn(s, stages, m, *args, **kw)) for s in range(stages)]


@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
def test_every_schedule_matches_and_cannot_deadlock_on_the_grid(mode):
    for stages in range(1, 9):
        for m in range(1, 17):
            simulate(_all(fill_drain, stages, m), mode)
            simulate(_all(fill_drain, stages, m, train=True), mode)
            simulate(_all(one_f_one_b, stages, m), mode)
            if stages >= 2 and m % stages == 0:
                for chunks in (2, 3):
                    simulate(_all(one_f_one_b, stages, m, chunks), mode)


def test_simulator_rounds_for_a_two_stage_fill_drain():
    # forward of stage 1 can only follow stage 0's; the run must take more rounds than one stage alone
    assert simulate(_all(fill_drain, 2, 1), "eager") > simulate(_all(fill_drain, 1, 1), "eager")


def test_broken_schedule_mismatched_message_is_caught():
    scheds = _all(one_f_one_b, 2, 2)
    i, j = scheds[1].index(RA(0)), scheds[1].index(RA(1))
    scheds[1][i], scheds[1][j] = RA(1), RA(0)  # stage 1 expects micro-batch 1 first
    with pytest.raises(ScheduleError) as err:
        simulate(scheds)
    assert "channel 0->1: message 0 is sent as" in str(err.value)
    assert "micro_batch=0" in str(err.value) and "micro_batch=1" in str(err.value)


def test_broken_schedule_missing_send_is_caught():
    scheds = _all(one_f_one_b, 2, 2)
    scheds[0].remove(SA(1))
    with pytest.raises(ScheduleError) as err:
        simulate(scheds)
    assert "channel 0->1: 1 message(s) received but never sent" in str(err.value)


def test_broken_schedule_deadlock_is_caught():
    scheds = _all(one_f_one_b, 2, 1)
    # stage 0 waits for the gradient before it sends the activation the gradient depends on
    scheds[0] = [L(0), F(0), RG(0), SA(0), B(0), *STEP]
    with pytest.raises(ScheduleError) as err:
        simulate(scheds, "eager")
    assert "deadlock (eager)" in str(err.value) and "RecvGrad(0, 0)" in str(err.value)


def test_rendezvous_catches_two_ranks_that_both_send_first():
    # fine with buffered sends, a deadlock when a send waits for its receive (large NCCL transfers)
    scheds = [[SA(0), F(1), RG(0)], [SG(0), F(1), RA(0)]]
    assert simulate(scheds, "eager") > 0
    with pytest.raises(ScheduleError) as err:
        simulate(scheds, "rendezvous")
    assert "deadlock (rendezvous)" in str(err.value)


def test_unknown_mode():
    with pytest.raises(ValueError) as err:
        simulate([[]], "lazy")
    assert "unknown mode 'lazy'" in str(err.value)
