"""The transport's batch plan (Note [negotiation inside a batch]) replayed in two models of NCCL.

Both: each rank posts its groups in order and they run in order; between two ranks, transfers in one
direction are matched in posting order (the k-th send must be the k-th receive's message); a
transfer completes when it and its counterpart are running at the same time (a send may wait for
its receive: large NCCL transfers do). "independent": all transfers of a group run together (NCCL's
documented promise). "epochs" (stricter, what NCCL's scheduler does): a group runs as steps, step e
holding the e-th send to each peer and the e-th receive from each peer, one step after the other.
Groups are built exactly as `Transport.run` builds them (`plan`), from the batches the pipeline
engine forms out of each schedule (consecutive communication instructions, keyed as in
`PipelineEngine._communicate`).
"""

from __future__ import annotations

import pytest
import torch

from zerospeed.parallel.pipeline import schedules as S
from zerospeed.parallel.pipeline.transport import (
    META_LEN,
    RecvOp,
    SendOp,
    Transfer,
    channel_code,
    decode,
    describe,
    encode,
    pack,
    packed_offsets,
    plan,
    unpack,
)


def engine_batches(stage: int, stages: int, schedule, mode: str) -> list[list[tuple]]:
    """(op, micro-batch) lists, one per run of communication instructions, as the engine keys them."""
    nxt, prev = (stage + 1) % stages, (stage - 1) % stages
    out, cur = [], []
    for ins in schedule:
        if not S.is_comm(ins):
            if cur:
                out.append(cur)
            cur = []
            continue
        vs = ins.chunk * stages + stage
        if isinstance(ins, S.SendActivation):
            op = SendOp(("act", vs, mode), None, nxt)
        elif isinstance(ins, S.RecvActivation):
            op = RecvOp(("act", vs - 1, mode), prev)
        elif isinstance(ins, S.SendGrad):
            op = SendOp(("grad", vs, mode), None, prev)
        else:
            op = RecvOp(("grad", vs + 1, mode), nxt)
        cur.append((op, ins.micro_batch))
    return out + ([cur] if cur else [])


def groups_of(batches: list[list[tuple]], split=plan, tensors=None) -> list[list[tuple]]:
    """Every group a rank posts: (kind, peer, message) with message ("layout", key) or ("data", key, mb,
    tensor index); `tensors(kind)` is how many tensors an "act" / "grad" message has (one transfer each)."""
    sent, received, groups = set(), set(), []
    for batch in batches:
        ops = [op for op, _ in batch]
        for part in split(ops, sent, received):
            group = []
            for tr in part:
                op, mb = batch[tr.op]
                if tr.what == "layout":
                    group.append((tr.kind, op.peer, ("layout", op.key)))
                    continue
                for t in range(tensors(op.key[0]) if tensors else 1):
                    group.append((tr.kind, op.peer, ("data", op.key, mb, t)))
            if group:
                groups.append(group)
        sent |= {op.key for op in ops if isinstance(op, SendOp)}
        received |= {op.key for op in ops if isinstance(op, RecvOp)}
    return groups


def _steps(group: list[tuple], mode: str) -> list[list[int]]:
    """The transfers of a group (indices) in the steps they run in."""
    if mode == "independent":
        return [list(range(len(group)))]
    steps, seen = [], {}
    for i, (kind, peer, _) in enumerate(group):
        e = seen[(kind, peer)] = seen.get((kind, peer), -1) + 1
        while len(steps) <= e:
            steps.append([])
        steps[e].append(i)
    return steps


def nccl_model(groups: list[list[list[tuple]]], mode: str = "epochs") -> int:
    """Run every rank's groups; returns the rounds taken, raises AssertionError on a mismatch or deadlock."""
    posted: dict[tuple, list] = {}  # (src, dst, side) -> [(message, rank, group, index)] in posting order
    for rank, gs in enumerate(groups):
        for g, group in enumerate(gs):
            for i, (kind, peer, msg) in enumerate(group):
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                posted.setdefault((src, dst, kind), []).append((msg, rank, g, i))
    counterpart: dict[tuple, tuple] = {}
    for (src, dst, kind), sends in posted.items():
        if kind != "send":
            continue
        recvs = posted.get((src, dst, "recv"), [])
        assert len(sends) == len(recvs), f"{src}->{dst}: {len(sends)} sends, {len(recvs)} receives"
        for k, (s, r) in enumerate(zip(sends, recvs)):
            assert s[0] == r[0], f"{src}->{dst} transfer {k}: sent {s[0]}, received as {r[0]}"
            counterpart[s[1:]], counterpart[r[1:]] = r[1:], s[1:]
    assert all((s, d, "send") in posted for s, d, kind in posted if kind == "recv"), "a receive without a send"
    steps = [[_steps(group, mode) for group in gs] for gs in groups]
    at = [(0, 0)] * len(groups)  # (group, step) each rank is running
    done: set = set()

    def running(rank: int, g: int, i: int) -> bool:
        return at[rank][0] == g and i in steps[rank][g][at[rank][1]]

    rounds = 0
    while any(g < len(gs) for (g, _), gs in zip(at, groups)):
        for r, (g, e) in enumerate(at):  # transfers meet their running counterparts
            if g < len(groups[r]):
                for i in steps[r][g][e]:
                    if (r, g, i) not in done and running(*counterpart[(r, g, i)]):
                        done |= {(r, g, i), counterpart[(r, g, i)]}
        moved = False
        for r, (g, e) in enumerate(at):  # a finished step lets the next one (or group) run
            if g < len(groups[r]) and all((r, g, i) in done for i in steps[r][g][e]):
                at[r] = (g, e + 1) if e + 1 < len(steps[r][g]) else (g + 1, 0)
                moved = True
        assert moved, f"deadlock ({mode}): {[(r, groups[r][g]) for r, (g, _) in enumerate(at) if g < len(groups[r])]}"
        rounds += 1
    return rounds


def _schedules(kind: str, stages: int, m: int, chunks: int):
    if kind == "1f1b":
        return [list(S.one_f_one_b(s, stages, m, chunks)) for s in range(stages)], "train"
    if kind == "fill_drain":
        return [list(S.fill_drain(s, stages, m, chunks, train=True)) for s in range(stages)], "train"
    return [list(S.fill_drain(s, stages, m, chunks)) for s in range(stages)], "eval"


def _grid():
    for stages in range(2, 9):
        for m in range(1, 17):
            for chunks in (1, 2, 3):
                if chunks == 1 or m % stages == 0:
                    yield stages, m, chunks


@pytest.mark.parametrize("mode", ["epochs", "independent"])
def test_every_schedule_through_the_plan_matches_and_cannot_deadlock_under_nccl(mode):
    for stages, m, chunks in _grid():
        for kind in ("1f1b", "fill_drain", "eval"):
            scheds, key_mode = _schedules(kind, stages, m, chunks)
            # two batches: the first negotiates every layout, the second must be all known keys
            batches = [engine_batches(s, stages, scheds[s], key_mode) * 2 for s in range(stages)]
            nccl_model([groups_of(b) for b in batches], mode)


def test_one_transfer_per_tensor_would_deadlock_tuple_messages():
    # Note [one transfer per message]: (hidden, mask) forward and one gradient back, one transfer each
    scheds, key_mode = _schedules("1f1b", 2, 1, 1)
    batches = [engine_batches(s, 2, scheds[s], key_mode) * 2 for s in range(2)]
    per_tensor = {"act": 2, "grad": 1}.get
    assert nccl_model([groups_of(b, tensors=per_tensor) for b in batches], "independent") > 0
    with pytest.raises(AssertionError, match="deadlock"):
        nccl_model([groups_of(b, tensors=per_tensor) for b in batches], "epochs")


def test_a_tuple_travels_as_one_aligned_byte_buffer():
    x, mask, ids = torch.randn(2, 3), torch.tensor([[True, False, True]]), torch.arange(5, dtype=torch.int16)
    meta = describe((x, mask, ids), "x")
    assert packed_offsets(meta) == ([0, 32, 48], 64)  # 24 bytes -> 32, 3 -> 16, 10 -> 16
    buf = pack([x, mask, ids], meta)
    assert buf.dtype == torch.uint8 and buf.shape == (64,)
    got = unpack(buf, meta)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, (x, mask, ids)))
    assert got[0].data_ptr() != buf.data_ptr()  # copies: independent autograd leaves
    lone = pack([x], describe(x, "x"))
    assert lone.data_ptr() == x.data_ptr() and lone.numel() == x.nbytes  # a lone tensor: its own bytes
    assert pack([], describe((), "x")) is None  # nothing to move


def test_once_every_key_is_known_each_batch_is_one_group():
    scheds, mode = _schedules("1f1b", 4, 8, 2)
    for s in range(4):
        batches = engine_batches(s, 4, scheds[s], mode)
        first_batch_groups = len(groups_of(batches))
        assert len(groups_of(batches * 2)) - first_batch_groups == len(batches)  # the repeat: one group each


def test_first_use_parts_follow_the_steady_state_group():
    # stage 0 of 1F1B on 2 stages, 1 micro-batch: send activation 0, receive gradient 0, both new
    ops = [SendOp(("act", 0, "train"), None, 1), RecvOp(("grad", 1, "train"), 1)]
    assert plan(ops, set(), set()) == [
        [],
        [Transfer("send", "layout", 0)],
        [Transfer("send", "data", 0)],
        [Transfer("recv", "layout", 1)],
        [Transfer("recv", "data", 1)],
    ]
    # steady state (both known): the one group
    known = plan(ops, {("act", 0, "train")}, {("grad", 1, "train")})
    assert known == [[Transfer("send", "data", 0), Transfer("recv", "data", 1)], [], [], [], []]
    # a key met twice in one batch carries one layout
    twice = [RecvOp(("act", 0, "eval"), 0), RecvOp(("act", 0, "eval"), 0)]
    assert plan(twice, set(), set())[3:] == [
        [Transfer("recv", "layout", 0)],
        [Transfer("recv", "data", 0), Transfer("recv", "data", 1)],
    ]


def _old_plan(ops, sent, received):
    """The previous design: group 1 = layouts and every send, group 2 = every data receive."""
    first, recvs = [], []
    for i, op in enumerate(ops):
        kind = "send" if isinstance(op, SendOp) else "recv"
        if op.key not in (sent if kind == "send" else received):
            first.append(Transfer(kind, "layout", i))
        (first if kind == "send" else recvs).append(Transfer(kind, "data", i))
    return first, recvs


def _layouts_first_plan(ops, sent, received):
    """The obvious alternative: every new layout in one group before the batch, then all its data."""
    layouts = [
        Transfer("send" if isinstance(op, SendOp) else "recv", "layout", i)
        for i, op in enumerate(ops)
        if op.key not in (sent if isinstance(op, SendOp) else received)
    ]
    return layouts, [Transfer("send" if isinstance(op, SendOp) else "recv", "data", i) for i, op in enumerate(ops)]


@pytest.mark.parametrize(
    "split, mode, stages, m",
    [
        (_old_plan, "epochs", 2, 1),
        (_old_plan, "independent", 2, 2),
        (_layouts_first_plan, "epochs", 2, 1),
        (_layouts_first_plan, "independent", 2, 1),
    ],
)
def test_the_models_find_the_deadlocks_of_the_rejected_designs(split, mode, stages, m):
    scheds, key_mode = _schedules("1f1b", stages, m, 1)
    batches = [engine_batches(s, stages, scheds[s], key_mode) for s in range(stages)]
    with pytest.raises(AssertionError, match="deadlock"):
        nccl_model([groups_of(b, split) for b in batches], mode)


def test_the_epoch_model_is_stricter_than_independent_transfers():
    # rank 0 posts one group [send a, send b, recv c]: NCCL's first step pairs a with c, b waits in the
    # second; rank 1 takes a and b, and only then sends c
    r0 = [[("send", 1, "a"), ("send", 1, "b"), ("recv", 1, "c")]]
    r1 = [[("recv", 0, "a"), ("recv", 0, "b")], [("send", 0, "c")]]
    assert nccl_model([r0, r1], "independent") > 0
    with pytest.raises(AssertionError, match="deadlock"):
        nccl_model([r0, r1], "epochs")


def test_layout_carries_its_channel_code():
    meta = describe((torch.zeros(2, 3), torch.ones(4, dtype=torch.int16)), "x")
    key = ("act", 3, "train")
    buf = encode(meta, key)
    assert buf.shape == (META_LEN,) and buf.dtype == torch.int64
    assert int(buf[-1]) == channel_code(key) != channel_code(("act", 3, "eval"))
    assert decode(buf) == meta
