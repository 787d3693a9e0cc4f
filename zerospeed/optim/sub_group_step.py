"""The optimizer step every ZeRO stage shares: scale the gradients, step in sub-groups.

It lives in `optim/` (not `zero/` or `offload/`) because both build on it: the ZeRO strategies call a
stepper, and the NVMe stepper in `offload/` reuses `step_one`; imports run zero -> offload -> optim.

Three steppers with one interface: `InMemoryStepper` (masters and optimizer states resident, on the
device or — with `offload_optimizer.device: cpu` — in host memory), `OverlappedStepper` (the same
memory, the host step on a worker thread: Note [overlapped step]) and
`zerospeed.offload.optimizer_swap.NvmeOptimizerSwapper` (masters and states live in swap files and
pass through a few host buffers, one sub-group at a time). A strategy hands any of them its
(master, gradient) pairs and a callback that publishes a sub-group's updated masters to the
parameters while they are resident.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zerospeed.accelerator import get_accelerator

OnStepped = Callable[[list[int]], None]


@torch.no_grad()
def step_in_sub_groups(
    optimizer: torch.optim.Optimizer,
    grads: list[tuple[torch.Tensor, torch.Tensor]],
    coef: float,
    sub_groups: list[list[int]] | None = None,
    on_stepped: OnStepped | None = None,
) -> None:
    """Multiply each (master, gradient) pair's gradient by `coef`, then step the optimizer.

    With `sub_groups` (lists of indices into `grads`) the optimizer steps one sub-group at a time:
    torch optimizers skip parameters whose .grad is None, so each step's temporaries cover at most
    `sub_group_size` elements. Gradients are attached only for the duration of their step.
    `on_stepped(indices)` runs after each sub-group's step.
    """
    scale_grads(grads, coef)
    for sub in sub_groups if sub_groups is not None else [list(range(len(grads)))]:
        step_one(optimizer, [grads[i] for i in sub])
        if on_stepped is not None:
            on_stepped(list(sub))


def scale_grads(grads: list[tuple[torch.Tensor, torch.Tensor]], coef: float) -> None:
    if coef != 1.0:
        for _, g in grads:
            g.mul_(coef)


def step_one(optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer.step() over exactly these (master, gradient) pairs."""
    for m, g in pairs:
        m.grad = g if g.dtype == m.dtype and g.device == m.device else g.to(m.device, m.dtype)
    optimizer.step()
    for m, _ in pairs:
        m.grad = None


class InMemoryStepper:
    """Masters and optimizer states stay resident; the step is `step_in_sub_groups`."""

    kind = "memory"

    def step(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped | None = None) -> None:
        step_in_sub_groups(optimizer, grads, coef, sub_groups, on_stepped)

    @contextlib.contextmanager
    def resident(self, optimizer) -> Iterator[None]:
        """Masters and states are always resident here."""
        yield

    def state_bytes_in_memory(self, optimizer) -> int | None:
        return None  # everything the optimizer holds is in memory

    def files(self) -> list:
        return []

    def close(self) -> None:
        pass


def use_fused_cpu_step(optimizer: torch.optim.Optimizer | None) -> None:
    """Offloaded Adam/AdamW steps with torch's fused CPU kernel: one pass over memory per flat
    sub-group instead of a pass per elementwise op (`benchmarks/cpu_adam.py` measures it). A
    `fused` or `foreach` the user set explicitly is kept."""
    if optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if (
            group.get("fused") is None
            and not group.get("foreach")
            and not group.get("differentiable")
            and not group.get("capturable")
        ):
            group["fused"] = True


# Note [overlapped step]: with `offload_optimizer.device: cpu` the host step is the long pole of an
# offloaded step, and today's sequence (whole backward, then every sub-group's host step, then every
# copy back) leaves the device idle for all of it. `OverlappedStepper` changes only *when* each
# sub-group steps, never *what* it computes: the same `scale_grads` and `step_one` on the same
# tensors in the same sub-group order, so the results are bitwise those of `step_in_sub_groups`.
#  - The steps run one at a time, in sub-group order, on a worker thread (torch's kernels release the
#    GIL); a step that overlaps the backward splits its fused kernel over `host_step_threads()` intra-op
#    threads (the cores but one, which the compute thread keeps), a step after the backward over the
#    compute thread's own count (Note [step threads]).
#  - The main thread waits for sub-group i and publishes it (the copy back to the parameters; on CUDA
#    on a side stream) while the worker steps sub-group i + 1.
#  - Early start: when the step's coefficient is known before the gradient norm (no clipping, no loss
#    scale, no skipping of non-finite steps: `OffloadPlan.early_step`) and the optimizer's step is
#    local to each tensor (torch's own optimizers), a sub-group is submitted during the boundary
#    backward as soon as the reduction has delivered its last fp32 gradient shard (`arm` / `ready`).
#    Its parameters are published only at `step()`: backward may still read the weights of stage
#    1-2's other units. Otherwise every sub-group is submitted at `step()` and only the pipelining
#    remains (the coefficient needs the global norm; SuperOffload's speculate-and-roll-back is not
#    built, docs/offload.md says why) -- on a device; on a CPU-only machine, where the copy back is at
#    most a cast, such a step runs inline as `step_in_sub_groups` (`copies_back`).
#  The early start commits the host step at the boundary backward, which has three visible
#  consequences, each refused loudly rather than run inexactly: a second boundary backward before
#  `engine.step()`, zeroing the gradients instead of stepping, and hyperparameters changed between the
#  backward and `engine.step()`. `overlap_step: false` restores the sequential step for such loops.
#  Every step runs on a snapshot of the optimizer's param groups taken when its hyperparameters were
#  fixed (`snapshot_optimizer`: at the boundary backward, checked unchanged at `step()`, or at `step()`), so a
#  step still running after `step()` returned does not read what the LR scheduler writes next.
#
# Note [deferred tail]: at stage 3 with parameter offload (`offload_param.device: cpu`) `start` returns
# as soon as every sub-group's step is submitted; the steps still running (the "tail") and their
# publication outlive `engine.step()`. The next forward then gathers a unit once the sub-group owning
# it is done (`finish(j)`, called from the unit's gather fence, zero/stage3/strategy.py), so its first
# units are gathered while later sub-groups still step. What the tail writes and when it is safe:
#  - the masters and optimizer states: the fences (gathers) and the strategy's barrier (`finish_all`)
#    in front of everything else that reads them (accessors, checkpoints, the next backward or step);
#  - the parameter shards: published on the main thread by `finish(j)`, before any gather reads them
#    (host to host copies: with parameter offload the shards live in host memory);
#  - the gradient shards, which the steps read: zeroed by a follow-up job after the last step (`then`),
#    not by the engine's `zero_grads` on the main thread; the next backward waits for it;
#  - the hyperparameters: the snapshot above.
# Only the order of work changes, never a value: same kernels, tensors and sub-group order.
#
# Note [step threads]: torch's intra-op thread count is set per thread (each thread's OpenMP setting,
# taken from a process-wide default when the thread first runs a parallel kernel), and
# `torch.set_num_threads` sets both the calling thread's and that default. So each count gets its own
# worker thread, which sets its count once, at start; the main thread then puts the process-wide
# default back, so the compute thread and any later thread keep the user's count. Two workers, one
# step at a time: each step waits for the one submitted before it.
# On a CPU-only machine the compute thread's team of intra-op threads is the "device": when it already
# takes every core of this rank, a busy step thread stalls each parallel region of the backward at its
# barrier, and the early start loses more than it hides (measured, benchmarks/offload_overlap.py: 0.88x
# at 2 compute threads on 2 cores; 0.76x with the step thread at nice 19, which then starves). So there
# the early start is on only when the compute leaves a core free (`spare_core()`; 1.04-1.14x at 1
# compute thread on 2 cores); on a device host the compute thread mostly waits on the device.


def steps_locally(optimizer) -> bool:
    """The optimizer's step reads and writes each parameter's own tensors only (no collectives, no
    device work): torch's own optimizers. Only those step on the worker thread."""
    return optimizer is not None and type(optimizer).__module__.startswith("torch.optim")


def _core_share() -> int:
    """The cores this rank may use: those of the process over the ranks on this host (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def spare_core() -> bool:
    """The compute thread's intra-op threads leave at least one of this rank's cores free."""
    return _core_share() > torch.get_num_threads()


def host_step_threads() -> int:
    """Intra-op threads of a host step that overlaps the compute: this rank's share of the cores (the
    ones this process may use over the ranks on this host, LOCAL_WORLD_SIZE), at most torch's own
    setting (OMP_NUM_THREADS, which the launcher sets per rank), less the compute thread's core."""
    return max(1, min(_core_share(), torch.get_num_threads()) - 1)


class OverlappedStepper(InMemoryStepper):
    """Note [overlapped step]: the resident host step, run per sub-group on a worker thread, overlapping
    the copy back (always) and the boundary backward (when the coefficient is known in advance)."""

    def __init__(self, sub_groups: list[list[int]], threads: int | None = None, copies_back: bool = True):
        self.sub_groups = sub_groups
        # publishing moves bytes to the device (on a CPU-only machine it is at most a cast, and pipelining
        # it with the steps gains less than a second thread's contention costs: those steps stay inline)
        self.copies_back = copies_back
        # steps may start during the backward (Note [step threads]: on a CPU-only machine, only when
        # the compute leaves a core free)
        self.may_start_early = copies_back or spare_core()
        self.threads = threads or host_step_threads()
        # Note [step threads]: one worker for steps that overlap the backward (the cores but the compute
        # thread's), one for steps after it (the compute thread's own count: it only publishes then)
        self._pools: dict[bool, ThreadPoolExecutor] = {}
        self._last: Future | None = None  # the latest submitted step: the next one runs after it
        self._jobs: dict[int, Future] = {}  # sub-group index -> its submitted step
        self._armed: tuple | None = None  # (optimizer snapshot, grads) of the boundary backward under way
        self._missing: list[int] = []  # per sub-group: deliveries still to come
        self._sub_of: dict[int, int] = {k: j for j, sub in enumerate(sub_groups) for k in sub}
        self._hparams = None  # the hyperparameters the early steps read
        self._armed_from = None  # the optimizer whose snapshot the early steps step
        # Note [deferred tail]: sub-group -> its step, still unpublished after `start` returned; the
        # publish callback; the last follow-up job
        self._tail: dict[int, Future] = {}
        self._tail_publish: OnStepped | None = None
        self._follow: Future | None = None
        self._side = None  # the publish stream (CUDA), made on first use
        # ("submit" | "start" | "end" | "finish", sub-group, perf_counter); "finish": a reader of the tail waits
        self.timeline: list[tuple[str, int, float]] = []

    # -- early start (the boundary backward) -------------------------------------------------------
    def arm(self, optimizer, grads: list[tuple[torch.Tensor, torch.Tensor]], needs: list[int]) -> None:
        """A boundary backward begins: sub-group j may step once `needs[k]` deliveries arrived for each of
        its chunks k (several reduction units can land in one chunk: stage 3's tied uses)."""
        self._check_consumed("a second boundary backward")
        self.timeline.clear()
        self._armed, self._armed_from = (snapshot_optimizer(optimizer), grads), optimizer
        self._missing = [sum(needs[k] for k in sub) for sub in self.sub_groups]
        self._hparams = _hparams(optimizer)

    def disarm(self) -> None:
        """A backward that does not end the accumulation window: its gradients are not final."""
        self._check_consumed("a backward")
        self._armed = None

    def ready(self, k: int) -> None:
        """One delivery of chunk k's final reduced gradient (called by the reducer's landing)."""
        if self._armed is None:
            return
        j = self._sub_of[k]
        self._missing[j] -= 1
        if self._missing[j] == 0:
            optimizer, grads = self._armed
            self._submit(j, optimizer, grads, 1.0, during_backward=True)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped | None = None) -> None:
        if self._jobs:
            self._check_early(optimizer, coef)
        elif not steps_locally(optimizer) or not self.copies_back:
            self._armed = None
            return step_in_sub_groups(optimizer, grads, coef, sub_groups, on_stepped)
        else:
            self.timeline.clear()
        self._armed = None
        try:
            for j in range(len(sub_groups)):
                if j not in self._jobs:
                    self._submit(j, optimizer, grads, coef, during_backward=False)
            self._publish_in_order(sub_groups, on_stepped)
        finally:
            self.settle()

    # -- the tail (Note [deferred tail]) ------------------------------------------------------------
    def start(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped) -> bool:
        """Submit every sub-group's step and return without waiting: `finish(j)` / `finish_all()` wait and
        publish. Returns False where the steps do not run on a worker (an optimizer that is not torch's,
        a CPU-only machine whose compute takes every core): it has then stepped and published as `step`."""
        self.finish_all()
        if not self._jobs and not (steps_locally(optimizer) and (self.copies_back or self.may_start_early)):
            self.step(optimizer, grads, coef, sub_groups, on_stepped)
            return False
        if self._jobs:
            self._check_early(optimizer, coef)
        else:
            self.timeline.clear()
        host = self._armed[0] if self._jobs else snapshot_optimizer(optimizer)  # (the early steps': checked unchanged)
        self._armed = None
        for j in range(len(sub_groups)):
            if j not in self._jobs:  # they overlap the next forward: the worker that leaves the compute a core
                self._submit(j, host, grads, coef, during_backward=True)
        self._tail, self._jobs, self._tail_publish = self._jobs, {}, on_stepped
        return True

    def finish(self, j: int) -> None:
        """Sub-group j's step is done and its masters are published (nothing if it was already)."""
        job = self._tail.pop(j, None)
        if job is not None:
            self.timeline.append(("finish", j, time.perf_counter()))  # a reader waits for sub-group j
            job.result()
            self._tail_publish(list(self.sub_groups[j]))

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the worker after every step submitted so far (the gradients' zeroing)."""
        self._last = self._follow = self._worker(True).submit(_after, self._last, fn)

    def finish_all(self) -> None:
        """Every step of the tail done and published, in step order, and every follow-up run."""
        for j in list(self._tail):
            self.finish(j)
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.result()

    @property
    def in_flight(self) -> bool:
        """Steps or follow-ups of the last `start` not yet finished."""
        return bool(self._tail) or self._follow is not None

    def _publish_in_order(self, sub_groups, on_stepped: OnStepped | None) -> None:
        """Sub-group i's copy back while the worker steps sub-group i + 1 (Note [overlapped step])."""
        accel = get_accelerator()
        if accel.Stream is not None and self._side is None:
            self._side = accel.Stream()
        current = accel.current_stream() if self._side is not None else None
        if self._side is not None:
            self._side.wait_stream(current)
        for j, sub in enumerate(sub_groups):
            self._jobs[j].result()
            if on_stepped is not None:
                with accel.stream(self._side):
                    on_stepped(list(sub))
        if self._side is not None:
            current.wait_stream(self._side)

    def _submit(self, j: int, optimizer, grads, coef: float, during_backward: bool) -> None:
        pairs = [grads[i] for i in self.sub_groups[j]]
        self.timeline.append(("submit", j, time.perf_counter()))
        after = self._last
        self._last = self._jobs[j] = self._worker(during_backward).submit(self._run, j, optimizer, pairs, coef, after)

    @torch.no_grad()
    def _run(self, j: int, optimizer, pairs, coef: float, after: Future | None) -> None:
        # one step at a time, in submission order: optimizer.step() steps every master holding a .grad
        if after is not None:
            after.result()
        self.timeline.append(("start", j, time.perf_counter()))
        scale_grads(pairs, coef)
        step_one(optimizer, pairs)
        self.timeline.append(("end", j, time.perf_counter()))

    def _worker(self, during_backward: bool) -> ThreadPoolExecutor:
        pool = self._pools.get(during_backward)
        if pool is None:
            compute_threads = torch.get_num_threads()
            pool = self._pools[during_backward] = ThreadPoolExecutor(1, thread_name_prefix="zerospeed-host-step")
            pool.submit(_own_threads, self.threads if during_backward else compute_threads).result()
            torch.set_num_threads(compute_threads)  # Note [step threads]: the process default back
        return pool

    # -- keeping the early start exact -------------------------------------------------------------
    def _check_early(self, optimizer, coef: float) -> None:
        optimizer_then = self._armed_from if self._armed is not None else optimizer
        problems = []
        if coef != 1.0:
            problems.append(f"the step's coefficient is {coef:g}, the early steps used 1")
        if optimizer is not optimizer_then or _hparams(optimizer) != self._hparams:
            problems.append("the optimizer or its hyperparameters changed after the boundary backward")
        if problems:
            self.settle()
            raise RuntimeError(
                "zero_optimization.offload_optimizer.overlap_step: the host step started during the boundary "
                f"backward, but {'; '.join(problems)}; set overlap_step to false for this training loop"
            )

    def _check_consumed(self, what: str) -> None:
        if self._jobs:
            self.settle()
            raise RuntimeError(
                f"zero_optimization.offload_optimizer.overlap_step: {what} came after a boundary backward whose "
                "host step had started, without engine.step() in between; call engine.step() after every "
                "boundary backward, or set overlap_step to false"
            )

    def settle(self) -> None:
        """Wait for every submitted step (their errors surface here) and forget them."""
        jobs, self._jobs, self._last = self._jobs, {}, None
        for job in jobs.values():
            job.result()

    def wait(self) -> None:
        """Wait for every submitted step, still counting them as this step's (an accessor between the
        boundary backward and `engine.step()` reads the masters and states after them)."""
        for job in list(self._jobs.values()):
            job.result()

    def discard(self) -> None:
        """The gradients are zeroed: a boundary backward's started steps without `engine.step()` is an error."""
        self._armed = None
        self._check_consumed("zeroing the gradients")

    @contextlib.contextmanager
    def resident(self, optimizer) -> Iterator[None]:
        """Nothing steps while a checkpoint reads or writes the masters and states."""
        self.finish_all()
        self.wait()
        yield

    def close(self) -> None:
        self.finish_all()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools = {}


def _own_threads(n: int) -> None:
    torch.get_num_threads()  # the worker's own setting starts from the process default ...
    torch.set_num_threads(n)  # ... and is then its own (Note [step threads])


def _after(before: Future | None, fn: Callable[[], None]) -> None:
    if before is not None:
        before.result()
    fn()


def snapshot_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer with its param groups as they are now (Note [overlapped step]): the same object but
    for copies of the group dicts, tensor values cloned (torch's schedulers fill a tensor lr in place);
    the same parameters, states and hooks. Not `copy.copy`, which goes through torch's `__getstate__`
    and drops the hooks; without the instance `step` torch's LR scheduler installs, which steps the
    original optimizer's groups. The original counts as stepped for torch's LR scheduler (its first
    `step()` warns otherwise): the snapshot steps in its place."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True
    host = object.__new__(type(optimizer))
    host.__dict__.update(optimizer.__dict__)
    host.__dict__.pop("step", None)
    host.param_groups = [
        {k: v.clone() if isinstance(v, torch.Tensor) and k != "params" else v for k, v in g.items()}
        for g in optimizer.param_groups
    ]
    return host


def _hparams(optimizer) -> list[list[tuple[str, object]]]:
    """Every group's hyperparameters, comparable (tensors as Python numbers)."""
    return [
        [(k, v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"]
        for group in optimizer.param_groups
    ]
