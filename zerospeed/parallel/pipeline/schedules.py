"""Pipeline schedules as pure generators of instructions (no processes, no tensors).

A pipeline of `stages` ranks may hold `chunks` model chunks per rank (interleaving): virtual stage
`vs = chunk * stages + stage`, so activations flow 0 -> 1 -> ... -> stages*chunks - 1 and wrap from
the last rank back to the first between chunks. Each schedule lists, for one rank, what it does in
order; `simulate.py` replays the lists of every rank together to prove that every send meets its
receive and that nothing can deadlock.

Note [where communication sits]: a send comes right after the compute that produced it, and the
receive for the next compute is hoisted to just after those sends (before the next load),
so a rank posts "send what I just made, receive what I need next" together (sends first, so the
eager model never blocks a send behind a receive). The engine runs each run
of consecutive communication instructions as one batch (all posted, then all awaited). Without the
hoist, interleaved 1F1B deadlocks when a send cannot complete before its receive is posted (large
NCCL transfers): rank 0 sends an activation while rank 1 sends a gradient, each waiting for the other
(the simulator's "rendezvous" mode finds it; Megatron fuses the same pairs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    """One step of a schedule; `micro_batch` and `chunk` say which micro-batch and model chunk."""

    micro_batch: int = -1
    chunk: int = 0

    def __repr__(self) -> str:
        if self.micro_batch < 0:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}({self.micro_batch}, {self.chunk})"


class LoadMicroBatch(Instruction):
    """Take the next micro-batch from the data iterator (first stage: inputs; last stage: labels)."""


class ForwardPass(Instruction):
    """Run the chunk forward on the micro-batch's input."""


class BackwardPass(Instruction):
    """Backpropagate the micro-batch through the chunk."""


class SendActivation(Instruction):
    """Send the chunk's output to the next virtual stage."""


class RecvActivation(Instruction):
    """Receive the chunk's input from the previous virtual stage."""


class SendGrad(Instruction):
    """Send the gradient of the chunk's input to the previous virtual stage."""


class RecvGrad(Instruction):
    """Receive the gradient of the chunk's output from the next virtual stage."""


class ReduceTiedGrads(Instruction):
    """Sum the gradients of weights tied across stages (e.g. embedding and output head)."""


class ReduceGrads(Instruction):
    """Reduce gradients across the stage's data-parallel group."""


class OptimizerStep(Instruction):
    """Clip, step the optimizer and the LR scheduler."""


COMM_TYPES = (SendActivation, RecvActivation, SendGrad, RecvGrad)


def is_comm(instr: Instruction) -> bool:
    return isinstance(instr, COMM_TYPES)


def _check(stage: int, stages: int, micro_batches: int, chunks: int) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside a pipeline of {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"a schedule needs at least 1 micro-batch, got {micro_batches}")
    if chunks < 1:
        raise ValueError(f"chunks per stage must be >= 1, got {chunks}")
    if chunks > 1 and stages < 2:
        raise ValueError("interleaving (chunks > 1) needs at least 2 pipeline stages")
    if chunks > 1 and micro_batches % stages:
        raise ValueError(
            f"the interleaved schedule needs micro-batches ({micro_batches}) divisible by "
            f"the number of stages ({stages})"
        )


def _forward_order(k: int, stages: int, chunks: int) -> tuple[int, int]:
    """The k-th forward of a rank under interleaving: (micro_batch, chunk).

    Micro-batches go through chunk 0 in groups of `stages`, then the same group through chunk 1, ...
    (Megatron's order), so each rank stays busy while the group travels around the ring.
    """
    group, pos = divmod(k, stages * chunks)
    return group * stages + pos % stages, pos // stages


def _backward_order(k: int, stages: int, chunks: int) -> tuple[int, int]:
    mb, chunk = _forward_order(k, stages, chunks)
    return mb, chunks - 1 - chunk


def _forward(stage: int, stages: int, chunks: int, mb: int, chunk: int) -> Iterator[Instruction]:
    vs, last = chunk * stages + stage, stages * chunks - 1
    if vs == 0 or vs == last:
        yield LoadMicroBatch(mb, chunk)
    if vs > 0:
        yield RecvActivation(mb, chunk)
    yield ForwardPass(mb, chunk)
    if vs < last:
        yield SendActivation(mb, chunk)


def _backward(stage: int, stages: int, chunks: int, mb: int, chunk: int) -> Iterator[Instruction]:
    vs, last = chunk * stages + stage, stages * chunks - 1
    if vs < last:
        yield RecvGrad(mb, chunk)
    yield BackwardPass(mb, chunk)
    if vs > 0:
        yield SendGrad(mb, chunk)


def _step() -> Iterator[Instruction]:
    yield ReduceTiedGrads()
    yield ReduceGrads()
    yield OptimizerStep()


def _hoist_receives(instrs: Iterator[Instruction]) -> Iterator[Instruction]:
    """Move each receive back to just after the sends of the previous compute (before any load)."""
    loads: list[Instruction] = []  # loads since the last compute wait until the next compute
    for instr in instrs:
        if isinstance(instr, LoadMicroBatch):
            loads.append(instr)
            continue
        if not is_comm(instr):
            yield from loads
            loads = []
        yield instr
    yield from loads


def fill_drain(
    stage: int, stages: int, micro_batches: int, chunks: int = 1, train: bool = False
) -> Iterator[Instruction]:
    """GPipe: every forward, then (training only) every backward in reverse order, then the step.

    Evaluation uses it with `train=False`; as a training schedule it holds the activations of all
    micro-batches at once (1F1B holds at most `stages`).
    """
    _check(stage, stages, micro_batches, chunks)
    return _hoist_receives(_fill_drain(stage, stages, micro_batches, chunks, train))


def _fill_drain(stage: int, stages: int, micro_batches: int, chunks: int, train: bool) -> Iterator[Instruction]:
    total = micro_batches * chunks
    for k in range(total):
        yield from _forward(stage, stages, chunks, *_forward_order(k, stages, chunks))
    if train:
        for k in range(total):
            yield from _backward(stage, stages, chunks, *_backward_order(k, stages, chunks))
        yield from _step()


def _pair_position(instr: Instruction) -> int:
    order = (RecvActivation, RecvGrad, LoadMicroBatch, ForwardPass, BackwardPass, SendActivation, SendGrad)
    return next(i for i, t in enumerate(order) if isinstance(instr, t))


def warmup_forwards(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Forwards a rank runs before its first backward under (interleaved) 1F1B."""
    total = micro_batches * chunks
    if chunks == 1:
        return min(stages - stage - 1, total)
    if micro_batches == stages:
        return total  # Megatron: with exactly one group of micro-batches there is no steady state
    return min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)


def one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> Iterator[Instruction]:
    """1F1B (PipeDream-flush); with `chunks` > 1 the interleaved variant over virtual stages.

    Warm-up forwards fill the pipeline, then each forward is followed by one backward, then the
    remaining backwards drain it; a rank never holds more than warm-up + 1 micro-batches' activations.
    """
    _check(stage, stages, micro_batches, chunks)
    return _hoist_receives(_one_f_one_b(stage, stages, micro_batches, chunks))


def _one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int) -> Iterator[Instruction]:
    total = micro_batches * chunks
    warm = warmup_forwards(stage, stages, micro_batches, chunks)
    for k in range(warm):
        yield from _forward(stage, stages, chunks, *_forward_order(k, stages, chunks))
    for k in range(total - warm):
        fwd = list(_forward(stage, stages, chunks, *_forward_order(warm + k, stages, chunks)))
        bwd = list(_backward(stage, stages, chunks, *_backward_order(k, stages, chunks)))
        if chunks == 1:
            yield from fwd + bwd
        else:
            # Note [interleaved pairs]: post both receives before the pair and both sends after it
            # (Megatron's fused exchange); sending each result at once deadlocks under rendezvous.
            yield from sorted(fwd + bwd, key=_pair_position)
    for k in range(total - warm, total):
        yield from _backward(stage, stages, chunks, *_backward_order(k, stages, chunks))
    yield from _step()


def interleaved_1f1b(stage: int, stages: int, micro_batches: int, chunks: int) -> Iterator[Instruction]:
    """Interleaved 1F1B with `chunks` virtual stages per rank (alias of `one_f_one_b` with chunks)."""
    return one_f_one_b(stage, stages, micro_batches, chunks)


def peak_in_flight(schedule: list[Instruction]) -> int:
    """Most micro-batch chunks whose forward ran but whose backward has not (activations held)."""
    live = peak = 0
    for instr in schedule:
        if isinstance(instr, ForwardPass):
            live += 1
            peak = max(peak, live)
        elif isinstance(instr, BackwardPass):
            live -= 1
    return peak
