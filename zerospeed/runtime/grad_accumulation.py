"""Where an accumulation window ends, and DeepSpeed's ways of letting the caller decide it.

Note [caller-managed accumulation]: DeepSpeed 0.19.8's `managed_gradient_accumulation` (default true).
Managed, the engine counts micro-steps: the window ends on every `gradient_accumulation_steps`-th
micro-step (or where `set_gradient_accumulation_boundary` forces it), and `step()` off the boundary
only counts. With `managed_gradient_accumulation: false` the caller owns the window:

- `is_gradient_accumulation_boundary()` is true only while `step()` runs; every `step()` ends the
  window and applies an update (`was_step_applied()` says whether it did: an fp16 overflow skips it);
- `backward()` only accumulates: stages 0-1 keep the gradients local (no collective) and reduce them
  in `step()`; stages 2-3 reduce-scatter every micro-step as always, so `step()` only steps;
- the loss is still divided by `gradient_accumulation_steps` (with `scale_wrt_gas`), so a window of k
  backwards averages correctly only when k equals it;
- `global_samples` grows by (train_batch_size / gradient_accumulation_steps) x the backwards since
  the last `step()`, not by `train_batch_size`;
- `set_gradient_accumulation_boundary` and `coalesce_grad_reduction` are refused (the caller already
  owns the boundary), as are ZeRO `overlap_comm` at stages 0-1 (config/parse.py) and the pipeline
  engine, all as DeepSpeed refuses them.

Note [coalesced reduction]: `engine.coalesce_grad_reduction()` (ZeRO 1-3, as DeepSpeed) is a
block in which every `backward` leaves its gradients unreduced on this rank; leaving the block runs one
reduction of their sum, so a window of k backwards costs one collective instead of k (ZeRO-2's
reduce-scatter) and the result is the same sum. One block is one window: `step()` inside it raises,
and it must start with no gradient pending (zerospeed refuses that; DeepSpeed does not check, and its
docstring warns that each flush overwrites the reduced gradients). The boundary state in force when the
block began is restored when it ends, as in DeepSpeed. At ZeRO-2 the block holds a full-size local
gradient buffer (`hold_local_gradients`), freed after the flush, as DeepSpeed's leaves each gradient on
its parameter. At ZeRO-3 each unit keeps its full-size staging buffer (fp32, or the communication
dtype) across the block's backwards instead of reduce-scattering it, while its gathered weights are
still released after its backward as always; the flush launches every unit's held staging in the usual
order with no backward at all (stage 3's parameters are shards, so no zero-gradient backward can reach
them) and frees it. So a block holds one full-size gradient of the whole model per rank, as
DeepSpeed's stage 3 does on each parameter's `.grad`.
"""

from __future__ import annotations

import contextlib

import torch

from zerospeed.utils.errors import UsageAssertionError


class AccumulationWindow:
    """The boundary state of one engine (Note [caller-managed accumulation])."""

    def __init__(self, managed: bool):
        self.managed = managed
        self.override: bool | None = None  # set_gradient_accumulation_boundary's value (managed only)
        self.in_step = False  # unmanaged: the boundary is exactly the inside of step()
        self.backwards = 0  # backwards since the last step(): the samples an unmanaged step counts
        self.coalescing = False

    def is_boundary(self, micro_steps: int, gas: int) -> bool:
        if self.override is not None:
            return self.override
        if not self.managed:
            return self.in_step
        return (micro_steps + 1) % gas == 0

    def set_boundary(self, is_boundary: bool | None) -> None:
        if not self.managed:
            raise UsageAssertionError(
                "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation=false: "
                "the caller owns the boundary by calling step() (set managed_gradient_accumulation to true "
                "to force boundaries instead)"
            )
        self.override = is_boundary

    def samples(self, train_batch_size: int, gas: int) -> int:
        """What the optimizer step about to run adds to `global_samples` (and restarts the count)."""
        count, self.backwards = self.backwards, 0
        return train_batch_size if self.managed else train_batch_size // gas * count


def trainable_params(param_groups: list[dict]) -> list[torch.nn.Parameter]:
    """The parameters a strategy's reducer hooks: every parameter of the groups, each once."""
    seen, out = set(), []
    for g in param_groups:
        for p in g["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def reduce_held_gradients(zero, params: list[torch.nn.Parameter]) -> None:
    """One reduction of the gradients the strategy holds unreduced (stages 0-1, or stage 2's full local
    buffers under `hold_local_gradients`): a backward of zero gradients with reduction on, which makes
    every parameter report to the reducer, so its units launch in their usual order through its own
    hooks (the pipeline's ReduceGrads does the same: Note [one reduction per batch] in runtime/pipeline.py).
    Stage 3 needs no backward: the reducer's `finish` launches the units no gradient reached, each with
    what it holds (Note [coalesced reduction])."""
    zero.begin_backward(sync=True)
    if zero.weights_in_shards:  # stage 3: its end of the micro-step launches every unit, reached or not
        zero.end_micro_step()
        return
    grads = [torch.zeros_like(p) for p in params]
    torch.autograd.backward(params, grads)
    zero.end_micro_step()


def check_coalesce(engine) -> None:
    """DeepSpeed's refusals for `coalesce_grad_reduction`, and zerospeed's own (1-bit optimizers)."""
    if not engine.managed_gradient_accumulation():
        raise UsageAssertionError(
            "coalesce_grad_reduction is not supported with managed_gradient_accumulation=false; "
            "the caller already owns the accumulation boundary via step()"
        )
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}")
    if hasattr(engine.optimizer, "bind_engine"):
        raise NotImplementedError(
            f"coalesce_grad_reduction does not support {type(engine.optimizer).__name__}: a 1-bit optimizer "
            "decides itself when gradients are reduced"
        )
    if engine._inside_no_sync:
        raise UsageAssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context")
    if engine.zero.has_grads():
        raise UsageAssertionError(
            "coalesce_grad_reduction: gradients from earlier backward calls are still pending; one block is "
            "one accumulation window: enter it right after step() (or engine.zero_grad())"
        )


@contextlib.contextmanager
def coalesced(engine, params: list[torch.nn.Parameter]):
    """Note [coalesced reduction]: the body of `engine.coalesce_grad_reduction()`."""
    check_coalesce(engine)
    window, zero = engine.window, engine.zero
    saved = window.override
    engine._inside_no_sync = window.coalescing = True
    zero.hold_local_gradients(True)  # ZeRO-2: full local buffers while the block runs (ZeRO-3: its staging)
    try:
        yield
    finally:
        engine._inside_no_sync = window.coalescing = False
        zero.reducer.hold_local = False  # reduce what was held, then free stage 2's local buffers
        try:
            reduce_held_gradients(zero, params)
        finally:
            zero.hold_local_gradients(False)
            window.override = saved
