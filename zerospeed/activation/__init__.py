"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``): ZeRO-R's
partitioned, CPU-offloaded and contiguous checkpoints. (Saving and loading *model* checkpoints is
`zerospeed.checkpoint`, DeepSpeed's ``deepspeed.checkpoint``; both paths are DeepSpeed's.)

    from zerospeed import checkpointing
    checkpointing.configure(mpu, deepspeed_config="ds_config.json")   # or keyword switches
    hidden = checkpointing.checkpoint(block, hidden, attention_mask)

``checkpoint`` keeps only a block's inputs in forward and recomputes the block in backward, with the
forward's random state replayed (identical dropout masks). What happens to the kept inputs is the
configured policy: partitioned over the model-parallel group, moved to host memory, copied into one
reused buffer. ``configure`` may be skipped; plain checkpointing is the default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.activation.function import CheckpointFunction, Runtime, run_checkpointed
from zerospeed.activation.policy import (
    CheckpointingPolicy,
    ModelParallel,
    config_section,
    model_parallel_from,
    resolve_policy,
)
from zerospeed.activation.rng import MODEL_PARALLEL_RNG, TRACKER, RngStatesTracker, model_parallel_manual_seed
from zerospeed.config.schema.misc import ActivationCheckpointingConfig

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointFunction",
    "CheckpointingPolicy",
    "RngStatesTracker",
    "checkpoint",
    "configure",
    "contiguous_buffer",
    "current_policy",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "partition_activations_in_checkpoint",
    "profile_report",
    "reset",
    "set_num_layers",
    "unconfigure",
]


class _State:
    """The process's checkpointing configuration (DeepSpeed's API is module-level, so one lives here)."""

    def __init__(self) -> None:
        self.configured = False
        self.mpu: Any = None
        self.runtime = Runtime()
        self.warned_no_partition = False


_STATE = _State()


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the checkpointing policy, as ``deepspeed.checkpointing.configure``.

    ``deepspeed_config`` (dict, JSON path, base64 JSON or a parsed ``ZeroSpeedConfig``) supplies the
    ``activation_checkpointing`` section; each keyword that is not None overrides its key
    (partition_activations, contiguous_checkpointing -> contiguous_memory_optimization,
    num_checkpoints -> number_checkpoints, checkpoint_in_cpu -> cpu_checkpointing,
    synchronize -> synchronize_checkpoint_boundary, profile). ``mpu_`` is a Megatron-style object
    whose model-parallel group partition_activations splits over; an earlier mpu is kept when None.
    Raises ``ConfigError`` naming the key on bad input.
    """
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    policy = resolve_policy(config_section(deepspeed_config), overrides)
    mpu = mpu_ if mpu_ is not None else _STATE.mpu
    mp = model_parallel_from(mpu)
    _STATE.mpu, _STATE.runtime, _STATE.configured = mpu, Runtime(policy, mp), True
    _log_configuration(policy, mp)


def _log_configuration(policy: CheckpointingPolicy, mp: ModelParallel) -> None:
    if policy.partition_activations and not mp.partitions and not _STATE.warned_no_partition:
        _STATE.warned_no_partition = True
        reason = (
            "no model-parallel group (mpu) was given"
            if mp.group is None and mp.world_size == 1
            else "the model-parallel world size is 1"
        )
        logger.warning(
            "activation_checkpointing.partition_activations=true has no effect: %s, so every rank "
            "keeps whole checkpointed inputs",
            reason,
        )
    if comm.get_rank() == 0:
        logger.info("activation checkpointing: %s, model-parallel size %d", policy, mp.world_size)


def is_configured() -> bool:
    """True once ``configure`` has been called (checkpoint() works either way)."""
    return _STATE.configured


def current_policy() -> CheckpointingPolicy:
    """The policy ``checkpoint`` applies now."""
    return _STATE.runtime.policy


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its intermediate activations.

    Returns what ``function`` returns: a tensor, or a tuple (a list comes back as a tuple) in which
    non-tensor items pass through. Tensor keyword arguments take part in autograd like positional ones.
    The backward recomputes ``function`` with the same random state; use ``loss.backward()``
    (``torch.autograd.grad`` is not supported by this re-entrant form).
    """
    if kwargs:
        function, args = _fold_kwargs(function, args, kwargs)
    return run_checkpointed(_STATE.runtime, function, *args)


def _fold_kwargs(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    keys, n = tuple(kwargs), len(args)

    def call(*all_args):
        return function(*all_args[:n], **dict(zip(keys, all_args[n:])))

    return call, args + tuple(kwargs.values())


def reset() -> None:
    """Forget the contiguous buffers (DeepSpeed: call after evaluation forwards that had no backward)."""
    _STATE.runtime.stasher.reset()


def unconfigure() -> None:
    """Back to the unconfigured defaults: plain checkpointing, no mpu, fresh profile, warnings re-armed,
    an empty model-parallel RNG tracker."""
    global _STATE
    _STATE = _State()
    TRACKER.reset()


def profile_report(log: bool = True) -> dict[str, dict[str, float]]:
    """Calls and seconds of checkpointed forwards, recomputes and backwards since configure(profile=True)."""
    report = _STATE.runtime.profile.report()
    if log:
        logger.info(
            "activation checkpointing profile: %s",
            ", ".join(f"{phase} {v['calls']} calls {v['seconds'] * 1e3:.1f} ms" for phase, v in report.items()),
        )
    return report


def contiguous_buffer(device: str | torch.device | None = None) -> torch.Tensor | None:
    """The contiguous_memory_optimization buffer on ``device`` (the only one when None), or None."""
    arenas = _STATE.runtime.stasher.arenas
    if device is None:
        return next((a.buffer for a in arenas.values()), None)
    arena = arenas.get(torch.device(device))
    return None if arena is None else arena.buffer


def get_cuda_rng_tracker() -> RngStatesTracker:
    """The model-parallel RNG tracker (its states are replayed by the recompute too)."""
    return TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` and the tracker's model-parallel stream per model-parallel rank."""
    model_parallel_manual_seed(seed, _STATE.runtime.mp.rank)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's shortcut: switch partition_activations, keeping the rest of the configuration."""
    configure(None, deepspeed_config=_policy_as_section(), partition_activations=partition_activation)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's shortcut: set number_checkpoints, keeping the rest of the configuration."""
    configure(None, deepspeed_config=_policy_as_section(), num_checkpoints=nlayers)


def _policy_as_section():
    return ActivationCheckpointingConfig(**vars(current_policy()))


__all__ += ["MODEL_PARALLEL_RNG"]
