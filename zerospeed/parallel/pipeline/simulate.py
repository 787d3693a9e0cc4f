"""Replay every rank's schedule together, without processes: matching and deadlock freedom.

Each communication instruction names a message: (kind, micro-batch, virtual stage that sent it) and a
channel (sender rank -> receiver rank). Messages on one channel are delivered in order, so the k-th
send on a channel must meet the k-th receive, and both must name the same message.

Two models of a send are checked:

* "eager": a send completes at once (buffered); a receive waits until its send was issued.
* "rendezvous" (stricter, what large NCCL transfers do): a send completes only together with its
  receive. Consecutive communication instructions of a rank form one batch, posted together, and a
  batch completes once every counterpart is posted — see Note [where communication sits] in
  schedules.py.

A schedule that passes "rendezvous" also passes "eager".
"""

from __future__ import annotations

from dataclasses import dataclass

from zerospeed.parallel.pipeline.schedules import (
    Instruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    is_comm,
)

MODES = ("eager", "rendezvous")


class ScheduleError(RuntimeError):
    """A schedule is wrong: unmatched or mismatched messages, or a deadlock."""


@dataclass(frozen=True)
class Message:
    kind: str  # "act" or "grad"
    micro_batch: int
    sender_vs: int  # the virtual stage that produced it
    src: int  # sender rank
    dst: int  # receiver rank


def message_of(instr: Instruction, rank: int, stages: int) -> tuple[str, Message]:
    """("send" | "recv", the message) of a communication instruction run by `rank`."""
    vs = instr.chunk * stages + rank
    mb = instr.micro_batch
    nxt, prev = (rank + 1) % stages, (rank - 1) % stages
    if isinstance(instr, SendActivation):
        return "send", Message("act", mb, vs, rank, nxt)
    if isinstance(instr, RecvActivation):
        return "recv", Message("act", mb, vs - 1, prev, rank)
    if isinstance(instr, SendGrad):
        return "send", Message("grad", mb, vs, rank, prev)
    if isinstance(instr, RecvGrad):
        return "recv", Message("grad", mb, vs + 1, nxt, rank)
    raise TypeError(f"{instr!r} is not a communication instruction")


def _units(schedule: list[Instruction], mode: str) -> list[list[int]]:
    """Instruction indices grouped into the units that complete together."""
    if mode == "eager":
        return [[i] for i in range(len(schedule))]
    units: list[list[int]] = []
    for i, instr in enumerate(schedule):
        if is_comm(instr) and units and is_comm(schedule[units[-1][-1]]):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _match(schedules: list[list[Instruction]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, instruction index) -> its counterpart's (rank, index); raises on any mismatch."""
    stages = len(schedules)
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, sched in enumerate(schedules):
        for i, instr in enumerate(sched):
            if is_comm(instr):
                side, msg = message_of(instr, rank, stages)
                (sends if side == "send" else recvs).setdefault((msg.src, msg.dst), []).append((msg, rank, i))
    pairs = {}
    for channel in sorted(set(sends) | set(recvs)):
        s, r = sends.get(channel, []), recvs.get(channel, [])
        for k, (sent, got) in enumerate(zip(s, r)):
            if sent[0] != got[0]:
                raise ScheduleError(
                    f"channel {channel[0]}->{channel[1]}: message {k} is sent as {sent[0]} but received as {got[0]}"
                )
            pairs[(sent[1], sent[2])] = (got[1], got[2])
            pairs[(got[1], got[2])] = (sent[1], sent[2])
        if len(s) != len(r):
            extra = s[len(r) :] or r[len(s) :]
            what = "sent but never received" if len(s) > len(r) else "received but never sent"
            raise ScheduleError(
                f"channel {channel[0]}->{channel[1]}: {abs(len(s) - len(r))} message(s) {what}, first {extra[0][0]}"
            )
    return pairs


def simulate(schedules: list[list[Instruction]], mode: str = "rendezvous") -> int:
    """Run the schedules of all ranks (index = pipeline stage); return the number of rounds taken.

    Raises ScheduleError naming the problem: a mismatched or unmatched message, or a deadlock with
    the instruction each rank is stuck on.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    pairs = _match(schedules)
    units = [_units(s, mode) for s in schedules]
    unit_of = [{i: u for u, idx in enumerate(us) for i in idx} for us in units]
    pos = [0] * len(schedules)  # index of the unit each rank is at

    def ready(rank: int) -> bool:
        for i in units[rank][pos[rank]]:
            instr = schedules[rank][i]
            if not is_comm(instr):
                continue
            peer, j = pairs[(rank, i)]
            side, _ = message_of(instr, rank, len(schedules))
            if mode == "eager":
                # a receive needs its send issued; a send never waits
                if side == "recv" and pos[peer] <= unit_of[peer][j]:
                    return False
            elif pos[peer] < unit_of[peer][j]:
                return False  # the counterpart is not posted yet
        return True

    rounds = 0
    while any(p < len(u) for p, u in zip(pos, units)):
        movable = [r for r in range(len(schedules)) if pos[r] < len(units[r]) and ready(r)]
        if not movable:
            stuck = {
                r: [schedules[r][i] for i in units[r][pos[r]]] for r in range(len(schedules)) if pos[r] < len(units[r])
            }
            raise ScheduleError(f"deadlock ({mode}): ranks are stuck at {stuck}")
        for r in movable:  # all units posted now complete together
            pos[r] += 1
        rounds += 1
    return rounds
