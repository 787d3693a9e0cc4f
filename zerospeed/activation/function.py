"""The checkpointed call: run without keeping intermediates, recompute them in backward.

``CheckpointFunction`` is a re-entrant autograd Function: its forward runs ``function`` under
``no_grad`` and keeps only the inputs (as the policy says: by reference, partitioned, on the host,
in the contiguous arena); its backward restores the inputs, replays the forward's random state,
recomputes with grad enabled and backpropagates through the recomputed graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.activation.policy import CheckpointingPolicy, ModelParallel
from zerospeed.activation.profile import CheckpointProfile
from zerospeed.activation.rng import RngSnapshot, replay, rng_devices
from zerospeed.activation.stash import SavedInput, Stasher

# Note [anchor]
# An autograd Function's outputs require grad only if one of its tensor inputs does. A block whose
# input does not require grad (the first block after a frozen embedding, integer ids) would then cut
# its own parameters out of the graph. Passing this grad-requiring empty tensor as an extra input keeps
# the outputs in the graph; its gradient is always None.
_ANCHOR = torch.empty(0, requires_grad=True)


@dataclass
class Runtime:
    """Everything one configure() decided, shared by the checkpoints made under it."""

    policy: CheckpointingPolicy = field(default_factory=CheckpointingPolicy)
    mp: ModelParallel = field(default_factory=ModelParallel)
    profile: CheckpointProfile = field(default_factory=CheckpointProfile)
    stasher: Stasher = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.profile.enabled = self.policy.profile
        if self.stasher is None:
            self.stasher = Stasher(self.policy, self.mp)

    @contextlib.contextmanager
    def boundary(self, phase: str) -> Iterator[None]:
        """synchronize_checkpoint_boundary: the device is idle on entry and on exit."""
        if self.policy.synchronize_checkpoint_boundary:
            get_accelerator().synchronize()
        with self.profile.measure(phase):
            yield
        if self.policy.synchronize_checkpoint_boundary:
            get_accelerator().synchronize()


_TENSOR = object()  # marks a tensor position in OutputLayout.items


@dataclass(frozen=True)
class OutputLayout:
    """Where the tensors sit among a function's outputs, so non-tensor outputs survive the Function.

    kind "tensor": one tensor; "sequence": a tuple/list (returned as a tuple, as in DeepSpeed) with
    tensors at the ``_TENSOR`` positions of ``items``; "opaque": no tensor at all, returned as is.
    """

    kind: str
    items: Any = None

    @classmethod
    def of(cls, outputs: Any) -> tuple[OutputLayout, tuple[torch.Tensor, ...]]:
        if torch.is_tensor(outputs):
            return cls("tensor"), (outputs,)
        tensors = tuple(o for o in outputs if torch.is_tensor(o)) if isinstance(outputs, (tuple, list)) else ()
        if not tensors:
            return cls("opaque", outputs), ()
        return cls("sequence", tuple(_TENSOR if torch.is_tensor(o) else o for o in outputs)), tensors

    def merge(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        if self.kind == "tensor":
            return tensors[0]
        if self.kind == "opaque":
            return self.items
        it = iter(tensors)
        return tuple(next(it) if item is _TENSOR else item for item in self.items)


def output_tensors(outputs: Any) -> tuple[torch.Tensor, ...]:
    return OutputLayout.of(outputs)[1]


@dataclass
class _Recorded:
    """Holds the output layout from forward for the caller (apply() only returns tensors)."""

    layout: OutputLayout | None = None


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Autocast settings of the host and the accelerator, so the recompute casts like the forward."""
    kinds = {"cpu", get_accelerator().name}
    return tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in sorted(kinds))


def _autocast(state: tuple[tuple[str, bool, torch.dtype], ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind, enabled, dtype in state:
        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
    return stack


class CheckpointFunction(torch.autograd.Function):
    """apply(run, runtime, recorded, anchor, *args) -> the tensors among run(*args)'s outputs."""

    @staticmethod
    def forward(ctx, run: Callable, runtime: Runtime, recorded: _Recorded, anchor, *args):
        with runtime.boundary("forward"):
            tensors_in = [a for a in args if torch.is_tensor(a)]
            ctx.rng = RngSnapshot.capture(rng_devices(tensors_in))
            ctx.autocast = _autocast_state()
            # Saved before the call, so an in-place change inside `run` cannot leak into the copies.
            ctx.saved = [runtime.stasher.save(a) if torch.is_tensor(a) else a for a in args]
            ctx.run, ctx.runtime = run, runtime
            with torch.no_grad():
                outputs = run(*args)
            layout, tensors = OutputLayout.of(outputs)
            recorded.layout = layout
            if layout.kind == "opaque":  # apply() must return a tensor; this one carries no gradient
                tensors = (torch.empty(0),)
                ctx.mark_non_differentiable(*tensors)
            ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
            return tensors

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "zerospeed checkpoint() does not support torch.autograd.grad(); call .backward() on the loss instead"
            )
        runtime: Runtime = ctx.runtime
        with runtime.boundary("backward"):
            inputs = [s.restore(runtime.mp, i) if isinstance(s, SavedInput) else s for i, s in enumerate(ctx.saved)]
            with runtime.profile.measure("recompute"), replay(ctx.rng), _autocast(ctx.autocast), torch.enable_grad():
                outputs = ctx.run(*inputs)
            _backward_through(output_tensors(outputs), grads)
            _release(ctx)
        input_grads = [x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs]
        return (None, None, None, None, *input_grads)


def _backward_through(outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _release(ctx) -> None:
    for s in ctx.saved:
        if isinstance(s, SavedInput):
            s.release()
    ctx.saved = ctx.run = None


def run_checkpointed(runtime: Runtime, function: Callable, *args: Any) -> Any:
    """``function(*args)``, recomputed in backward instead of keeping its intermediates."""
    if not torch.is_grad_enabled():  # nothing will call backward: just run it
        with runtime.boundary("forward"):
            return function(*args)
    recorded = _Recorded()
    tensors = CheckpointFunction.apply(function, runtime, recorded, _ANCHOR, *args)
    return recorded.layout.merge(tensors)
