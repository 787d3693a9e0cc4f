"""Step hooks: how data-side techniques attach to the training step without living in it.

A hook is a small object with three moments (each a no-op unless the hook needs it):

    before_forward(engine) -> dict | None   a training forward: keyword arguments for the model
    before_step(engine)                     an accumulation boundary, before the optimizer step
    after_step(engine)                      an accumulation boundary, after the optimizer step

The engine keeps a list of them, built from its plans (`SchedulesPlan`, runtime/plans.py) plus the
compression scheduler when `init_compression` compressed the model, and calls them in order; with no
technique on, the list is empty and the step loops over nothing. The schedulers stay reachable under
DeepSpeed's attribute names (`engine.curriculum_scheduler_legacy`, `engine.progressive_layer_drop`,
`engine.random_ltd_scheduler`, `engine.compression_scheduler`: runtime/deepspeed_api.py).

Note [forward schedules]: only a training forward (`module.training`) of the plain engine gets them;
the pipeline engine runs its stages itself and passes none (DeepSpeed's does not either). Before each
such forward the curriculum moves to the difficulty of step `global_steps + 1` (the step this forward
belongs to) and, for `curriculum_type: "seqlen"`, the model receives it as `curriculum_seqlen`. The
layer-drop theta moves at each accumulation boundary, from the step count before the optimizer runs,
so the first step's forwards see theta 1.0. The engine's values replace the caller's keyword arguments
of the same name. Random-LTD's scheduler moves to step `global_steps` (not + 1: DeepSpeed's moment, so
the first step's forwards keep min_value tokens, rounded down to seq_per_step) before each training
forward; the layers read it there (data/random_ltd/layer.py). The pipeline engine refuses
random-LTD (DeepSpeed's never binds layers in its stages either). The compression scheduler counts
optimizer steps: it moves after each one.
"""

from __future__ import annotations

from zerospeed.compression.scheduler import compression_scheduler
from zerospeed.data.curriculum import CurriculumScheduler
from zerospeed.data.progressive_layer_drop import ProgressiveLayerDrop
from zerospeed.data.random_ltd.helper import bind_random_ltd_layers
from zerospeed.data.random_ltd.scheduler import RandomLTDScheduler
from zerospeed.utils.errors import ConfigError


class StepHook:
    """A technique the training step runs at its moments (the base: every moment a no-op)."""

    scheduler: object = None
    """The technique's own state object (DeepSpeed's scheduler), for the engine's attribute names."""

    def before_forward(self, engine) -> dict | None:
        return None

    def before_step(self, engine) -> None:
        return None

    def after_step(self, engine) -> None:
        return None


class RandomLTDHook(StepHook):
    """Random-LTD: the reserved token count follows the step (Note [forward schedules])."""

    def __init__(self, scheduler: RandomLTDScheduler):
        self.scheduler = scheduler

    def before_forward(self, engine) -> None:
        self.scheduler.update_seq(engine.global_steps)


class LayerDropHook(StepHook):
    """Progressive layer drop: theta moves at each boundary; each training forward receives it."""

    def __init__(self, scheduler: ProgressiveLayerDrop):
        self.scheduler = scheduler

    def before_forward(self, engine) -> dict:
        return self.scheduler.get_state()

    def before_step(self, engine) -> None:
        self.scheduler.update_state(engine.global_steps)


class CurriculumHook(StepHook):
    """The legacy curriculum: the difficulty of the coming step, as `curriculum_seqlen` for "seqlen"."""

    def __init__(self, scheduler: CurriculumScheduler, seqlen: bool):
        self.scheduler, self.seqlen = scheduler, seqlen

    def before_forward(self, engine) -> dict | None:
        difficulty = self.scheduler.update_difficulty(engine.global_steps + 1)
        return {"curriculum_seqlen": difficulty} if self.seqlen else None


class CompressionHook(StepHook):
    """`compression_scheduler`: tells each compressed layer the optimizer step count."""

    def __init__(self, scheduler: compression_scheduler):
        self.scheduler = scheduler

    def after_step(self, engine) -> None:
        self.scheduler.step()


def build_step_hooks(plan) -> list[StepHook]:
    """The hooks of a `SchedulesPlan`, in the order their forward arguments are merged."""
    hooks: list[StepHook] = []
    if plan.random_ltd is not None:
        hooks.append(RandomLTDHook(RandomLTDScheduler(plan.random_ltd)))
    if plan.layer_drop is not None:
        hooks.append(LayerDropHook(ProgressiveLayerDrop(*plan.layer_drop)))
    if plan.curriculum is not None:
        hooks.append(CurriculumHook(CurriculumScheduler(plan.curriculum), plan.curriculum_seqlen))
    return hooks


def scheduler_of(hooks: list[StepHook], kind: type[StepHook]):
    """The scheduler of the hook of `kind` among `hooks`, else None (DeepSpeed's attribute names)."""
    return next((h.scheduler for h in hooks if type(h) is kind), None)


def bind_random_ltd(engine) -> None:
    """DeepSpeed's `engine.random_ltd_initialize()`: bind the wrapped layers of `engine.module` named by
    random_ltd_layer_id to the engine's scheduler."""
    if engine.random_ltd_scheduler is None:
        raise ConfigError(
            "random-LTD layers need data_efficiency.data_routing.random_ltd.enabled=true (with its "
            "schedule) in the config before convert_to_random_ltd / random_ltd_initialize"
        )
    bind_random_ltd_layers(engine.module, engine.random_ltd_config(), engine.random_ltd_scheduler)
