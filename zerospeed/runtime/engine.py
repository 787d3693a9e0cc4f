"""The Engine: a DeepSpeed-style training step, one micro-batch at a time.

A step is `engine(batch)` -> `engine.backward(loss)` -> `engine.step()`, called once per
micro-batch; the optimizer acts at accumulation boundaries, between the step hooks' `before_step` and
`after_step` (runtime/hooks.py). Everything it is made of — precision, the ZeRO strategy, optimizer,
scheduler, loss scaler, hooks, counters — is the shared `EngineCore` (runtime/core.py), which the
`PipelineEngine` is built on too; DeepSpeed's accessor surface is the `DeepSpeedAPI` facade over it
(runtime/deepspeed_api.py).
"""

from __future__ import annotations

import contextlib

import torch

from zerospeed.compression.scheduler import scheduler_for
from zerospeed.precision.autocast import forward_autocast
from zerospeed.precision.casting import cast_floating
from zerospeed.runtime.core import EngineCore
from zerospeed.runtime.deepspeed_api import DeepSpeedAPI
from zerospeed.runtime.grad_accumulation import AccumulationWindow, coalesced, reduce_held_gradients, trainable_params
from zerospeed.runtime.hooks import CompressionHook
from zerospeed.utils.errors import IncompatibleUsageError, UsageAssertionError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)


class Engine(DeepSpeedAPI, EngineCore):
    """A DeepSpeed-style training engine around `module` (built by `zerospeed.initialize`)."""

    def __init__(self, module: torch.nn.Module, config, plans, **kwargs):
        super().__init__(module, config, plans, **kwargs)
        # Note [caller-managed accumulation] (runtime/grad_accumulation.py)
        self.window = AccumulationWindow(managed=config.managed_gradient_accumulation)
        self._trainable = trainable_params(kwargs["param_groups"])
        self._inside_no_sync = False
        self._device_type = self.accelerator.device_name()
        compressed = scheduler_for(module)  # None unless init_compression ran on it
        if compressed is not None:
            self.step_hooks.append(CompressionHook(compressed))

    # -- accumulation boundaries -------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends the accumulation window (unmanaged: true only inside step())."""
        return self.window.is_boundary(self.micro_steps, self.gradient_accumulation_steps())

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force (or, with None, stop forcing) whether the coming step is a boundary."""
        self.window.set_boundary(is_boundary)

    def coalesce_grad_reduction(self):
        """DeepSpeed's context manager: every backward inside leaves its gradients unreduced, leaving it runs
        one reduction of their sum (ZeRO 1-3; Note [coalesced reduction] in runtime/grad_accumulation.py)."""
        return coalesced(self, self._trainable)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction inside the block; gradients keep accumulating locally (stages 0-1).

        As DeepSpeed's: an AssertionError at ZeRO 2-3, when nested, and for `step()` inside the block (an
        `IncompatibleUsageError`, also a RuntimeError as zerospeed raised it before)."""
        if not self.zero.supports_no_sync:
            stage = self.zero_optimization_stage()
            raise IncompatibleUsageError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}: "
                "gradients are partitioned as they are produced; use stage 0 or 1 to accumulate without communication"
            )
        if self._inside_no_sync:
            raise IncompatibleUsageError(
                "no_sync context manager reentry is unsupported (already inside no_sync() or coalesce_grad_reduction())"
            )
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # -- torch.compile ---------------------------------------------------------------------------------
    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's `engine.compile`: `torch.compile` the model in place (`nn.Module.compile`), once.

        `backend` defaults to the accelerator's (`get_accelerator().get_compile_backend()`: inductor);
        `compile_kwargs` go to torch.compile (a `backend` among them is overridden by the argument, with a
        warning, as DeepSpeed does). ZeRO-3's gather / release hooks and zerospeed's collectives run
        outside the compiled graphs (Note [compiled modules at stage 3] in zero/stage3/strategy.py).
        `schedule` (DeepCompile's compiler passes) and `compiled_autograd_enabled` are refused: neither
        DeepCompile nor compiled autograd is built."""
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile(schedule=...) schedules DeepCompile's passes; DeepCompile is "
                "not built in zerospeed: call compile() without a schedule (plain torch.compile)"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                "built in zerospeed; the backward runs eagerly (leave it False)"
            )
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning(
                "engine.compile: the `backend` in compile_kwargs is overridden; use the `backend` argument instead"
            )
        kwargs["backend"] = backend if backend is not None else self.accelerator.get_compile_backend()
        self.module.compile(**kwargs)
        self._is_compiled = True
        self._compile_kwargs = compile_kwargs or {}

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    # -- the training step -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._check_states_resident("engine forward")
        if self.zero.weights_in_shards and _under_torch_func():  # Note [torch.func on the engine] (docs/zero.md)
            raise NotImplementedError(
                "torch.func transforms (grad, vmap, jacrev, ...) through the engine need whole weights: "
                "ZeRO stage 3 gathers them with hooks that functorch cannot trace. Use ZeRO stage 0-2, "
                "or gather the weights yourself (zero.GatheredParameters) and transform a plain copy"
            )
        self.zero.start_micro_step()
        self.observer.on_forward_start(self, *inputs)
        if self.plans.cast_inputs is not None:  # `fp16.auto_cast` (DeepSpeed's: positional inputs only)
            inputs = cast_floating(inputs, self.plans.cast_inputs)
        if self.step_hooks and self.module.training:  # Note [forward schedules]: curriculum seqlen, theta, ...
            for hook in self.step_hooks:
                extra = hook.before_forward(self)
                if extra:
                    kwargs.update(extra)
        with forward_autocast(self._device_type, self.precision.autocast_dtype):  # `torch_autocast`
            out = self.module(*inputs, **kwargs)
        self.observer.on_forward_end(self)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate `loss` / gradient_accumulation_steps (times the fp16 loss scale)."""
        scaled = self._begin_backward(loss, scale_wrt_gas, "engine.backward")
        scaled.backward(retain_graph=retain_graph)
        self._end_backward()
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's, for a backward the caller runs itself: `engine.scale(loss).backward()` then
        `engine.step()`. Returns `loss` / gradient_accumulation_steps (times the fp16 loss scale) and
        arms the micro-step's reduction, which runs when that backward pass finishes (an autograd
        callback queued as the pass reaches the loss), exactly as in `engine.backward`."""
        if self.optimizer is None:
            raise RuntimeError("engine.scale needs an optimizer: give one to initialize (config or client)")
        if loss.numel() != 1 or loss.grad_fn is None:  # Note [errors catchable as DeepSpeed's] (utils/errors.py)
            raise UsageAssertionError(
                "engine.scale: the loss must be a one-element tensor with a grad_fn (got shape "
                f"{tuple(loss.shape)}); reduce it to a scalar first"
            )
        scaled = self._begin_backward(loss, True, "engine.scale")

        def arm(grad):
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            return grad

        scaled.register_hook(arm)
        return scaled

    def _begin_backward(self, loss: torch.Tensor, scale_wrt_gas: bool, caller: str) -> torch.Tensor:
        if not loss.requires_grad:
            raise RuntimeError(
                f"{caller}: the loss does not require grad (was it computed under torch.no_grad() or engine.eval()?)"
            )
        self._check_states_resident(caller)
        scaled = self.scale_loss(loss, scale_wrt_gas)
        self.zero.begin_backward(
            sync=self.is_gradient_accumulation_boundary()
            and not self._inside_no_sync
            and self.enable_backward_allreduce
        )
        self.window.backwards += 1
        self.observer.on_backward_start(self, loss)
        return scaled

    def _end_backward(self) -> None:
        self.observer.on_reduce_start(self)
        # the micro-step's reduction settles here, not in step(): accelerate (and so the stock
        # Trainer) calls engine.step() only at accumulation boundaries, as DeepSpeed allows
        self.zero.end_micro_step()
        self.observer.on_backward_end(self)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At an accumulation boundary: reduce, unscale, check overflow, clip, step; else count."""
        if self.window.coalescing:
            raise UsageAssertionError("engine.step() inside coalesce_grad_reduction(): call it after the block")
        if self._inside_no_sync:  # as DeepSpeed: a step there would update each rank from its own gradients
            raise IncompatibleUsageError(
                "It is illegal to call Engine.step() inside no_sync context manager: leave the block first; "
                "the gradients accumulated inside are reduced by the next backward at the accumulation boundary"
            )
        self._check_states_resident("engine.step")
        self.observer.on_step_start(self)
        self._step_applied = False  # DeepSpeed's: True only after a micro-step whose step() updated the weights
        self.window.in_step = True  # Note [caller-managed accumulation]: the unmanaged boundary
        try:
            if not self.window.managed and self.zero.supports_no_sync and self.enable_backward_allreduce:
                reduce_held_gradients(self.zero, self._trainable)  # stages 0-1 held this window's gradients
            if self.is_gradient_accumulation_boundary():
                for hook in self.step_hooks:  # Note [forward schedules]: layer drop's theta moves here
                    hook.before_step(self)
                samples = self.window.samples(self.train_batch_size(), self.gradient_accumulation_steps())
                self.take_model_step(lr_kwargs, samples=samples)
                for hook in self.step_hooks:  # the compression scheduler counts optimizer steps
                    hook.after_step(self)
        finally:
            self.window.in_step = False
        self.micro_steps += 1
        self.observer.on_step_end(self)


DeepSpeedEngine = Engine  # DeepSpeed's name (`deepspeed.DeepSpeedEngine`, `deepspeed.runtime.engine.DeepSpeedEngine`)


def _under_torch_func() -> bool:
    """True inside a torch.func transform (grad, vmap, jacrev, ...): functorch's interpreter stack is not empty."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
