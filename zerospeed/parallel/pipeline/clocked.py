"""DeepSpeed's pipeline schedules (`deepspeed.runtime.pipe.schedule`): zerospeed's schedules on a global clock.

zerospeed's schedules (schedules.py) list what one rank does, in order. DeepSpeed's list it per *clock step*
of the whole pipeline: every rank yields one list of instructions per step (empty while it waits), so a barrier
between steps cannot deadlock, and instructions name a pipeline *buffer* (`buffer_id`) instead of a
micro-batch. This module is that view, and nothing else: the order of the computations comes from
`one_f_one_b` (training) and `fill_drain` (inference); each computation is placed on its clock step, and the
communication around it is written in DeepSpeed's step form.

Note [the pipeline clock]: with S stages, stage s runs the forward of micro-batch m at step 2m + s and its
backward at step 2m + 2S - 1 - s (training: forwards and backwards alternate, so a stage is busy on every
other step once the pipeline is full, and 2 (M + S - 1) steps run M micro-batches); at inference, the forward
of m runs at step m + s (M + S - 1 steps). A result leaves on the step after it was computed: the activation
of a forward (or the input gradient of a backward) is sent in the stage's next step, together with the
receive for that step's own work. `buffer_id` is `m % num_pipe_buffers()`; a stage holds at most S - s
micro-batches between their forward and backward (1F1B), so that many buffers (at least 2) suffice.
"""

from __future__ import annotations

from collections.abc import Iterator

from zerospeed.parallel.pipeline import schedules as zs


def call_to_str(base: str, *args, **kwargs) -> str:
    """`base(arg, ..., key=value, ...)` with each value's repr: how an instruction prints (DeepSpeed's
    `runtime.utils.call_to_str`)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


class PipeInstruction:
    """One instruction of a clocked schedule; keyword arguments become attributes (`buffer_id=...`)."""

    def __init__(self, **kwargs) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    __hash__ = None


class OptimizerStep(PipeInstruction):
    """Clip, step the optimizer and the LR scheduler (the end of a training batch)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the stage's data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of weights tied across stages."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer."""

    def __init__(self, buffer_id: int, **kwargs) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into the buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage forward on the buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate the buffer's micro-batch through the stage."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's input from the previous stage."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""


def forward_step(micro_batch: int, stage: int, stages: int, train: bool = True) -> int:
    """The clock step of a forward (Note [the pipeline clock])."""
    return 2 * micro_batch + stage if train else micro_batch + stage


def backward_step(micro_batch: int, stage: int, stages: int) -> int:
    """The clock step of a backward (Note [the pipeline clock])."""
    return 2 * micro_batch + 2 * stages - 1 - stage


def clock_of(stream: list[zs.Instruction], stage: int, stages: int, train: bool) -> dict[int, zs.Instruction]:
    """Clock step -> the computation (ForwardPass / BackwardPass) of `stream` placed on it.

    The steps must rise along the stream: the clock reorders nothing, it only spaces the computations out."""
    placed: dict[int, zs.Instruction] = {}
    last = -1
    for instr in stream:
        if isinstance(instr, zs.ForwardPass):
            step = forward_step(instr.micro_batch, stage, stages, train)
        elif isinstance(instr, zs.BackwardPass):
            step = backward_step(instr.micro_batch, stage, stages)
        else:
            continue
        if step <= last:
            raise AssertionError(f"{instr} lands on clock step {step}, not after step {last}")
        placed[step], last = instr, step
    return placed


class PipeSchedule:
    """A clocked schedule of one stage: iterate it for one list of instructions per clock step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs (micro-batches in flight at once)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} outside 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    stage = property(lambda self: self.stage_id)
    num_stages = property(lambda self: self.stages)
    num_micro_batches = property(lambda self: self.micro_batches)
    is_first_stage = property(lambda self: self.stage_id == 0)
    is_last_stage = property(lambda self: self.stage_id == self.stages - 1)

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return iter(self.steps())


class TrainSchedule(PipeSchedule):
    """1F1B training (zerospeed's `one_f_one_b`) on the clock: 2 (M + S - 1) steps."""

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self) -> Iterator[list[PipeInstruction]]:
        stream = list(zs.one_f_one_b(self.stage_id, self.stages, self.micro_batches))
        placed = clock_of(stream, self.stage_id, self.stages, train=True)
        total = 2 * (self.micro_batches + self.stages - 1)
        before = None  # the computation of the stage's previous step, whose result leaves now
        for step in range(total):
            now = placed.get(step)
            yield self._step(before, now) + (self._batch_end(stream) if step == total - 1 else [])
            before = now

    def _step(self, before, now) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = []
        forward = isinstance(now, zs.ForwardPass) or (now is None and isinstance(before, zs.BackwardPass))
        if forward:
            if isinstance(before, zs.BackwardPass) and self._valid_stage(self.prev_stage):
                cmds.append(SendGrad(self._buffer_idx(before.micro_batch)))
            if now is not None and self._valid_stage(self.prev_stage):
                cmds.append(RecvActivation(self._buffer_idx(now.micro_batch)))
        else:
            if now is not None and self._valid_stage(self.next_stage):
                cmds.append(RecvGrad(self._buffer_idx(now.micro_batch)))
            if isinstance(before, zs.ForwardPass) and self._valid_stage(self.next_stage):
                cmds.append(SendActivation(self._buffer_idx(before.micro_batch)))
        if now is None:
            return cmds
        buffer = self._buffer_idx(now.micro_batch)
        if isinstance(now, zs.ForwardPass):
            if self.is_first_stage or self.is_last_stage:
                cmds.append(LoadMicroBatch(buffer))
            cmds.append(ForwardPass(buffer))
        else:
            cmds.append(BackwardPass(buffer))
        return cmds

    @staticmethod
    def _batch_end(stream) -> list[PipeInstruction]:
        kinds = {zs.ReduceTiedGrads: ReduceTiedGrads, zs.ReduceGrads: ReduceGrads, zs.OptimizerStep: OptimizerStep}
        return [kinds[type(instr)]() for instr in stream if type(instr) in kinds]


class InferenceSchedule(PipeSchedule):
    """Forward-only (zerospeed's `fill_drain` without training) on the clock: M + S - 1 steps, two buffers
    used alternately. Even stages send before they receive and odd stages receive first, so neighbours'
    blocking transfers pair up."""

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[PipeInstruction]]:
        stream = list(zs.fill_drain(self.stage_id, self.stages, self.micro_batches, train=False))
        placed = clock_of(stream, self.stage_id, self.stages, train=False)
        sent = None
        for step in range(self.micro_batches + self.stages - 1):
            now = placed.get(step)
            recv_buf, send_buf = (step + self.stage_id) % 2, (step + self.stage_id + 1) % 2
            cmds: list[PipeInstruction] = []
            if now is not None and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if sent is not None and self._valid_stage(self.next_stage) else []
            recv = [RecvActivation(recv_buf)] if now is not None and self._valid_stage(self.prev_stage) else []
            cmds += send + recv if self.stage_id % 2 == 0 else recv + send
            if now is not None:
                cmds.append(ForwardPass(recv_buf))
            sent = now
            yield cmds


class DataParallelSchedule(PipeSchedule):
    """One stage, gradient accumulation: load, forward, backward per micro-batch; the step after the last."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds
