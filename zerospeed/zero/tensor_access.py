"""DeepSpeed's parameter accessors (`deepspeed.utils.safe_get_full_fp32_param` & co.) at every ZeRO stage.

The strategy that trains a parameter is found by identity and describes where its state lives on
this rank (Note [parameter fragments] in zero/fragment.py); these functions only move values.

- *full* getters return the whole value with the parameter's shape, fp32, on the device the model
  computes on, as a new tensor. They are collectives at stages 1-3 (every rank of the parameter's
  data-parallel group must call them, in the same order); at stage 0 every rank already holds the
  whole value. `safe_get_full_grad` returns `param.grad` itself where one exists (stage 0, as
  DeepSpeed does).
- *local* getters return this rank's piece of the flattened parameter (1-D, unpadded, a view where it
  lives on the compute device), an empty tensor when this rank holds none of it (a parameter that lies
  in other ranks' shards: DeepSpeed gives every rank a padded piece of each parameter, so code written
  for it expects a tensor for every trained parameter); concatenated over the ranks in rank order they
  are the flattened full value. At stage 0 a rank's piece is the whole parameter.
- *setters* write the fp32 master (or optimizer state, or gradient) so that the next step uses it;
  the fp32 setters also refresh the model's own (low-precision) weights, so the next forward computes
  with the new value too. Call them on every rank of the group as well: `safe_set_full_*` take the
  whole value (the same on every rank) and communicate nothing; `safe_set_local_*` take this rank's
  piece, and `safe_set_local_fp32_param` assembles the new whole weight (a collective at stages 1-3).
- A parameter no strategy trains (frozen, or no engine) gives None, and setters ignore it.

The gradient is the one the next `engine.step()` would use, as it stands after `engine.backward`: at
stage 0-1 before the accumulation boundary this rank's local accumulated gradient, after it (and at
stages 2-3 always) the data-parallel average accumulated so far. With fp16 it is still multiplied by
the loss scale (DeepSpeed unscales inside the step too). After a step there is none (None).
"""

from __future__ import annotations

import contextlib

import torch

from zerospeed.zero import fragment as _fragment
from zerospeed.zero.fragment import Held, ParamFragment, assemble

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]


# -- full values ---------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of `param` (collective at stages 1-3)."""
    with _located(param) as (_, frag):
        return None if frag is None else assemble(frag.master, frag)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of `param` after backward, before step (collective at stages 1-3)."""
    if param.grad is not None:
        return param.grad
    frag = _fragment_of(param)
    if frag is None or frag.grad is None:
        return None
    return assemble(frag.grad, frag)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state `optim_state_key` (e.g. "exp_avg") of `param` (collective at
    stages 1-3); None before the optimizer's first step created any state."""
    with _located(param, optimizer=True) as (strategy, frag):
        held = None if frag is None else _state(strategy, frag, optim_state_key)
        return None if held is None else assemble(held, frag)


@torch.no_grad()
def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master — and the model's weight — to the whole `value` (given on every rank)."""
    with _located(param, optimizer=True) as (strategy, frag):
        if frag is not None:
            _write_piece(frag.master, _whole(value, frag), True)
            strategy.refresh_weights(param, value)


@torch.no_grad()
def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set `param`'s optimizer state `optim_state_key` to the whole `value` (given on every rank)."""
    with _located(param, optimizer=True) as (strategy, frag):
        if frag is not None:
            _write_piece(_existing_state(strategy, frag, optim_state_key), _whole(value, frag), True)


@torch.no_grad()
def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s gradient (after backward, before step) to the whole `value` (given on every rank)."""
    if param.grad is not None:
        param.grad.copy_(value)
        return
    frag = _fragment_of(param)
    if frag is not None:
        _write_piece(_grad(frag), _whole(value, frag), True)


# -- this rank's pieces --------------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of `param`'s fp32 master (1-D; empty where the rank holds none), or None (untrained)."""
    with _located(param) as (_, frag):
        return None if frag is None else _local(frag.master, frag)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of `param`'s gradient (1-D, fp32; empty where the rank holds none), or None (no gradient)."""
    frag = _fragment_of(param)
    if frag is None or frag.grad is None:
        return None
    return _local(frag.grad, frag)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of `param`'s optimizer state `optim_state_key` (1-D), or None."""
    with _located(param, optimizer=True) as (strategy, frag):
        held = None if frag is None else _state(strategy, frag, optim_state_key)
        return None if held is None else _local(held, frag)


@torch.no_grad()
def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of `param`'s fp32 master (and of the weights it computes with)."""
    with _located(param, optimizer=True) as (strategy, frag):
        if frag is not None:
            _write_piece(frag.master, _piece(value, frag.master), False)
            strategy.refresh_weights(param, assemble(frag.master, frag))


@torch.no_grad()
def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's piece of `param`'s optimizer state `optim_state_key`."""
    with _located(param, optimizer=True) as (strategy, frag):
        if frag is not None:
            held = _existing_state(strategy, frag, optim_state_key)
            _write_piece(held, _piece(value, held), False)


@torch.no_grad()
def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of `param`'s gradient (after backward, before step)."""
    frag = _fragment_of(param)
    if frag is not None:
        held = _grad(frag)
        _write_piece(held, _piece(value, held), False)


# -- the mechanics -------------------------------------------------------------------------------
def _fragment_of(param: torch.Tensor) -> ParamFragment | None:
    strategy = _fragment.owner_of(param)
    return None if strategy is None else strategy.param_fragment(param)


@contextlib.contextmanager
def _located(param: torch.Tensor, optimizer: bool = False):
    """(owning strategy, fragment) with masters and optimizer states in memory for the duration
    (NVMe-offloaded ones are read in, and written back afterwards)."""
    strategy = _fragment.owner_of(param)
    if strategy is None:
        yield None, None
        return
    with strategy.resident(strategy.optimizer_for_accessors() if optimizer else None):
        yield strategy, strategy.param_fragment(param)


def _local(held: Held, frag: ParamFragment) -> torch.Tensor:
    if held.numel == 0:
        return torch.empty(0, dtype=torch.float32, device=frag.device)
    piece = held.view()
    return (
        piece if piece.device == frag.device and piece.dtype == torch.float32 else piece.to(frag.device, torch.float32)
    )


def _whole(value: torch.Tensor, frag: ParamFragment) -> torch.Tensor:
    flat = value.reshape(-1)
    if flat.numel() != frag.numel:
        raise ValueError(
            f"value has {flat.numel()} elements; the parameter of shape {tuple(frag.shape)} has {frag.numel}"
        )
    return flat


def _piece(value: torch.Tensor | None, held: Held) -> torch.Tensor:
    """A local value: exactly this rank's piece (None or empty where the rank holds none)."""
    flat = value.reshape(-1) if value is not None else torch.empty(0)
    if flat.numel() != held.numel:
        raise ValueError(
            f"value has {flat.numel()} elements; this rank's piece of the parameter has {held.numel} "
            f"(elements [{held.start}, {held.start + held.numel}) of the flattened parameter, "
            "what safe_get_local_* returns)"
        )
    return flat


def _write_piece(held: Held, flat: torch.Tensor, whole: bool) -> None:
    """This rank's piece from `flat`: the whole flattened value (`whole`), or exactly the piece."""
    if held.numel:
        held.view().copy_(flat[held.start : held.start + held.numel] if whole else flat)


def _state(strategy, frag: ParamFragment, key: str) -> Held | None:
    optimizer = strategy.optimizer_for_accessors()
    state = optimizer.state.get(frag.master.tensor) if optimizer is not None else None
    if not state:
        return None  # no step yet
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != frag.master.tensor.shape:
        shape = frag.master.tensor.shape
        keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shape)
        raise ValueError(
            f"optimizer state {key!r} is not an elementwise state of {type(optimizer).__name__}; "
            f"its elementwise states are {keys}"
        )
    return frag.master.on(value)


def _existing_state(strategy, frag: ParamFragment, key: str) -> Held:
    held = _state(strategy, frag, key)
    if held is None:
        raise RuntimeError(
            f"optimizer state {key!r} does not exist yet: the optimizer creates its states at its first step"
        )
    return held


def _grad(frag: ParamFragment) -> Held:
    if frag.grad is None:
        raise ValueError("gradients are only available after backward and before the engine's step")
    return frag.grad


def safe_update_full_grad_vectorized(param_list, update_func) -> None:
    """Set each parameter's whole gradient to `update_func(whole gradient, param)` (after backward, before step;
    collective at stages 1-3: every rank passes the same list). Parameters without a gradient are skipped."""
    for param in param_list:
        if param.grad is None and not param.requires_grad:
            continue
        current = safe_get_full_grad(param)
        if current is not None:
            safe_set_full_grad(param, update_func(current, param))
