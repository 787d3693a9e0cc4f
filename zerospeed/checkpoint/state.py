"""`TrainingState`: everything a checkpoint saves and restores, handed to it by the engine.

The checkpoint never looks inside the engine: it receives this object (torchtitan's checkpointer
receives `states={"train_state": ...}` the same way) and reads and writes only what is here — the
module, the ZeRO strategy (the `ZeroStrategy` protocol), the optimizer, the parallel mesh, the dtypes,
the counters, the config data a checkpoint records, and the other stateful parts by name.

Note [live counters]: the counters are an object the engine keeps counting on (`Counters`: the engine
itself, or whatever holds its step counts), not a copy: a load writes the restored counts into it,
so the engine continues from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from zerospeed.comm.mesh import ParallelMesh
from zerospeed.zero.strategy import ZeroStrategy


@runtime_checkable
class Stateful(Protocol):
    """A part whose state a checkpoint carries (LR scheduler, loss scaler, data sampler, random-LTD schedule)."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> Any: ...


class Counters(Protocol):
    """The step counts a checkpoint saves and a load sets (Note [live counters])."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int


@dataclass(frozen=True)
class TrainingState:
    """What `save_checkpoint` / `load_checkpoint` / `save_16bit_model` work on."""

    module: torch.nn.Module
    zero: ZeroStrategy
    optimizer: torch.optim.Optimizer | None
    mesh: ParallelMesh
    counters: Counters  # Note [live counters]
    gradient_accumulation_steps: int
    param_dtype: torch.dtype  # the training dtype of the weights (the manifest records it)
    master_dtype: torch.dtype  # the optimizer's masters
    ds_config: dict = field(default_factory=dict)  # the run's config as JSON, recorded in the model states
    tag_validation: str = "WARN"  # checkpoint.tag_validation: FAIL, WARN or IGNORE
    lr_scheduler: Stateful | None = None
    loss_scaler: Stateful | None = None
    data_sampler: Stateful | None = None  # the training dataloader's sampler position
    random_ltd: Stateful | None = None  # the random-LTD schedule
    delayed_update: Stateful | None = None
    """The delayed parameter update's stepper (offload/delayed_update.py), when it is on: its `state_dict()`
    is saved, and a load hands it back before the weights are refreshed (Note [delayed update in
    checkpoints]); its `pending` then says whether they stay one update behind the masters."""
    param_group_names: list[list[str]] = field(default_factory=list)
    """The trained parameters' names per optimizer param group, in order: a DeepSpeed ZeRO-0 checkpoint
    indexes its optimizer states by that position (Note [DeepSpeed checkpoints] in deepspeed_import.py)."""


DELAYED_UPDATE = "delayed_param_update"  # the model states' key of the delayed update's record


def _state_of(part: Stateful | None) -> dict | None:
    return part.state_dict() if part is not None else None


# Keys of the model states file that are not client state (DeepSpeed merges client_state at top level).
RESERVED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "optimizer_type",
        "optimizer_param_groups",
        "lr_scheduler",
        "loss_scaler",
        "data_sampler",
        "global_steps",
        "global_samples",
        "skipped_steps",
        "micro_steps",
        "gradient_accumulation_steps",
        "dp_world_size",
        "mp_world_size",
        "zero_stage",
        "ds_config",
        "ds_version",
        "random_ltd",
        DELAYED_UPDATE,
        # with checkpoint.deepspeed_layout at ZeRO 0: DeepSpeed's optimizer state and zerospeed's entries
        # (Note [as-saved ZeRO 0] in deepspeed_layout.py)
        "optimizer",
        "entries",
    }
)


def training_state_dict(state: TrainingState) -> dict:
    """The training state a checkpoint's model-states file holds besides the weights (DeepSpeed's keys)."""
    opt, counters = state.optimizer, state.counters
    return {
        "optimizer_type": type(opt).__name__ if opt is not None else None,
        "optimizer_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if opt is not None
        else [],
        "lr_scheduler": _state_of(state.lr_scheduler),
        "loss_scaler": _state_of(state.loss_scaler),
        "data_sampler": _state_of(state.data_sampler),
        "random_ltd": _state_of(state.random_ltd),
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "skipped_steps": counters.skipped_steps,
        "micro_steps": counters.micro_steps,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        **({DELAYED_UPDATE: state.delayed_update.state_dict()} if state.delayed_update is not None else {}),
    }


# a param group's identity is this engine's: its parameters, and its name ("ep_size_4" loading "ep_size_2")
_GROUP_IDENTITY = frozenset({"params", "name", "moe"})


def restore_training_state(state: TrainingState, saved: dict, *, with_optimizer: bool, with_scheduler: bool) -> None:
    """Put a checkpoint's training state (`saved`: `training_state_dict`'s keys; a DeepSpeed checkpoint has
    fewer) back: the optimizer's hyperparameters (only the lr the scheduler set, for a scheduler-only load),
    the LR scheduler, loss scale, counters, data sampler and random-LTD schedule. A key the checkpoint lacks
    leaves its part as it is; the micro-step count is recomputed when the accumulation steps changed."""
    opt = state.optimizer
    if opt is not None and (with_optimizer or with_scheduler):
        for group, hyper in zip(opt.param_groups, saved.get("optimizer_param_groups") or []):
            for k, v in hyper.items():
                if k in _GROUP_IDENTITY or k not in group or (not with_optimizer and k != "lr"):
                    continue
                if isinstance(group[k], torch.Tensor) and isinstance(v, torch.Tensor):
                    group[k].copy_(v)  # capturable optimizers keep lr as a tensor: same object, new value
                else:
                    group[k] = v
    if with_scheduler and state.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
        state.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if state.loss_scaler is not None and saved.get("loss_scaler"):
        state.loss_scaler.load_state_dict(saved["loss_scaler"])
    counters, gas = state.counters, state.gradient_accumulation_steps
    counters.global_steps = int(saved.get("global_steps") or 0)
    counters.global_samples = int(saved.get("global_samples") or 0)
    counters.skipped_steps = int(saved.get("skipped_steps") or 0)
    same_window = saved.get("gradient_accumulation_steps") == gas and saved.get("micro_steps") is not None
    counters.micro_steps = int(saved["micro_steps"]) if same_window else counters.global_steps * gas
    if state.data_sampler is not None and saved.get("data_sampler") is not None:
        state.data_sampler.load_state_dict(saved["data_sampler"])
    if state.random_ltd is not None and saved.get("random_ltd") is not None:
        state.random_ltd.load_state_dict(saved["random_ltd"])
