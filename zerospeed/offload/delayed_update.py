"""ZeRO-Offload's one-step delayed parameter update (`offload_optimizer.delayed_param_update`).

Note [delayed parameter update]: ZeRO-Offload (Ren et al., USENIX ATC 2021, "DPU") hides the host
optimizer step behind the next step's forward and backward by letting that step compute with
parameters one update old. With w_t the parameters after t updates and g_t the gradient of step t:

    steps t < warm_up:  g_t = grad(w_t);      w_{t+1} = opt(w_t, g_t), published at once (as today)
    steps t >= warm_up: g_t = grad(w_{t-1})   (w_{t-1}: what the parameters held when step t began;
                                               w_{warm_up - 1} = w_warm_up for the first one)
                        w_{t+1} = opt(w_t, g_t), computed on the host during step t+1's forward and
                        backward, published at step t+1's `engine.step()`

so the host step of step t runs while step t+1's forward and backward use the parameters from step
t-1. Everything about g_t is as usual (reduction, norm, clipping coefficient, the hyperparameters of
step t: the LR scheduler writing the next lr meanwhile does not reach the running step, which steps a
copy of the optimizer's param groups); only *which weights* it was computed at changes: each gradient
is one update stale (the convergence cost, docs/offload.md). At `engine.step()` of step t+1 the
stepper waits for step t's host step, publishes its masters to the parameters (the strategy then
all-gathers them), copies g_{t+1} times its coefficient into its own gradient buffers (the next
backward writes the strategy's) and starts step t+1's host step on a worker thread.

Everything the background step touches is its own for the duration: the masters (never the
parameters' storage: `OffloadPlan.masters_apart` keeps them apart even where fp32 masters would alias
the parameter chunks), the optimizer states and the gradient copies. A caller that reads or writes a
master (DeepSpeed's `safe_get_full_fp32_param` & co., a checkpoint) waits for it first.

Note [delayed update in checkpoints]: a save after step t holds the in-flight result, not a flushed
one. It waits for step t's host step and writes what the run holds: the masters w_{t+1} and their
moments (after t+1 updates) in the shard files, the weights the model computes with, w_t, in the model
states (at stages 1-2 they hold every trainable weight), and this stepper's `state_dict()` (its step
count, for the warm-up, and `pending`: the masters are one update ahead of the weights) under the
model states' key `delayed_param_update`. A load into an engine with the delay gives it back as it was:
the weights stay the module state's (no refresh from the masters) and the next `engine.step()`
publishes the masters, so the resumed run is the uninterrupted one, bitwise. Publishing at the save
instead (a flush) would change the run that saves: its next forward would see w_{t+1} a step early.
An engine without the delay (or a load without the optimizer states) refreshes the weights from the
loaded masters as after any load: the pending update is published at the load, and the run goes on
with the plain rule from w_{t+1}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zerospeed.optim.sub_group_step import (
    InMemoryStepper,
    OnStepped,
    _own_threads,
    host_step_threads,
    snapshot_optimizer,
    step_in_sub_groups,
    steps_locally,
)


class DelayedStepper(InMemoryStepper):
    """Note [delayed parameter update]: the resident host step, one step late, on a worker thread."""

    def __init__(self, warm_up: int = 0, threads: int | None = None):
        self.warm_up = warm_up
        self.threads = threads or host_step_threads()  # Note [step threads] (optim/sub_group_step.py)
        self.steps = 0  # optimizer steps this stepper has taken
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None  # the host step in flight
        self._pending = False  # the masters hold a host result the parameters do not have yet
        self._grads: list[torch.Tensor] | None = None  # the host step's own copy of the gradients

    @torch.no_grad()
    def step(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped | None = None) -> None:
        self.steps += 1
        if self.steps <= self.warm_up:
            self._pending = False  # (a loaded pending update, if any, is published with this step's)
            return step_in_sub_groups(optimizer, grads, coef, sub_groups, on_stepped)
        if not steps_locally(optimizer):
            raise RuntimeError(
                "zero_optimization.offload_optimizer.delayed_param_update runs the optimizer's step on a worker "
                f"thread, which needs one of torch's optimizers (a step local to each tensor); "
                f"{type(optimizer).__name__} is not: set delayed_param_update to false"
            )
        self.wait()
        if self._pending and on_stepped is not None:  # the previous step's result, for the next forward
            for sub in sub_groups:
                on_stepped(list(sub))
        pairs = [(m, g2) for (m, _), g2 in zip(grads, self._copy(grads, coef))]
        host = snapshot_optimizer(optimizer)  # this step's hyperparameters, whatever the scheduler writes next
        self._pending = True
        self._job = self._worker().submit(step_in_sub_groups, host, pairs, 1.0, sub_groups)

    def _copy(self, grads, coef: float) -> list[torch.Tensor]:
        if self._grads is None or [g.shape for g in self._grads] != [g.shape for _, g in grads]:
            self._grads = [torch.empty_like(g) for _, g in grads]
        for mine, (_, g) in zip(self._grads, grads):
            if coef != 1.0:
                torch.mul(g, coef, out=mine)
            else:
                mine.copy_(g)
        return self._grads

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            compute_threads = torch.get_num_threads()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zerospeed-delayed-step")
            self._pool.submit(_own_threads, self.threads).result()
            torch.set_num_threads(compute_threads)  # Note [step threads]: the process default back
        return self._pool

    def wait(self) -> None:
        """Wait for the host step in flight (its error surfaces here); its result stays unpublished."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    @contextlib.contextmanager
    def resident(self, optimizer) -> Iterator[None]:
        """A checkpoint reads or writes the masters and states after the step in flight (Note [delayed
        update in checkpoints])."""
        self.wait()
        yield

    @property
    def pending(self) -> bool:
        """The masters hold an update the parameters do not have yet (the next step publishes it)."""
        return self._pending

    def state_dict(self) -> dict:
        """What a checkpoint records (Note [delayed update in checkpoints])."""
        return {"steps": self.steps, "pending": self._pending}

    def load_state_dict(self, state: dict | None) -> None:
        """After a load wrote the masters: a checkpoint's record back (`pending`: the caller left the
        weights one update behind them). None (no record, or no optimizer states loaded): nothing
        pending, and the warm-up counts from the load."""
        self.wait()
        state = state or {}
        self.steps = int(state.get("steps", 0))
        self._pending = bool(state.get("pending", False))

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def delayed_stepper(strategy) -> DelayedStepper | None:
    """The strategy's stepper when it runs the delayed update (what a checkpoint records), else None."""
    stepper = getattr(strategy, "stepper", None)
    return stepper if isinstance(stepper, DelayedStepper) else None
