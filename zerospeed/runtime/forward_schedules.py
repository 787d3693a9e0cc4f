"""Schedules the engine moves before each training forward, as DeepSpeed's engine does: the legacy
curriculum (`curriculum_learning`: `curriculum_seqlen=`) and progressive layer drop
(`progressive_layer_drop`: `progressive_layer_drop=True, pld_theta=`), fed to the model as keyword
arguments, and random-LTD's reserved length (`data_efficiency.data_routing.random_ltd`), which the
wrapped layers read from the scheduler themselves.

Note [forward schedules]: only a training forward (`module.training`) of the plain engine gets them;
the pipeline engine runs its stages itself and passes none (DeepSpeed's does not either). Before each
such forward the curriculum moves to the difficulty of step `global_steps + 1` (the step this forward
belongs to) and, for `curriculum_type: "seqlen"`, the model receives it as `curriculum_seqlen`. The
layer-drop theta moves at each accumulation boundary, from the step count before the optimizer runs,
so the first step's forwards see theta 1.0. The engine's values replace the caller's keyword arguments
of the same name. Random-LTD's scheduler moves to step `global_steps` (not + 1: DeepSpeed's moment, so
the first step's forwards keep min_value tokens, rounded down to seq_per_step) before each training
forward; the layers read it there (data_routing/basic_layer.py). The pipeline engine refuses
random-LTD (DeepSpeed's never binds layers in its stages either).
"""
from __future__ import annotations

from zerospeed.utils.errors import ConfigError
from zerospeed.data.curriculum import CurriculumScheduler
from zerospeed.data.random_ltd.helper import bind_random_ltd_layers
from zerospeed.data.random_ltd.scheduler import RandomLTDScheduler
from zerospeed.data.progressive_layer_drop import ProgressiveLayerDrop
from zerospeed.utils.logging import logger


def build_forward_schedules(config) -> tuple[CurriculumScheduler | None, ProgressiveLayerDrop | None]:
    """The enabled schedules of a parsed config (None for each one off)."""
    cl, pld = config.curriculum_learning, config.progressive_layer_drop
    curriculum = CurriculumScheduler(cl.model_dump()) if cl.enabled else None
    return curriculum, (ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None)


def random_ltd_config(config) -> dict:
    """DeepSpeed's `engine.random_ltd_config()`: the `random_ltd` block with the engine's batch sizes."""
    return {**config.data_efficiency.data_routing.random_ltd.model_dump(),
            "global_batch_size": config.train_batch_size, "micro_batch_size": config.train_micro_batch_size_per_gpu}


def build_random_ltd_scheduler(config) -> RandomLTDScheduler | None:
    """Random-LTD's scheduler when `random_ltd.enabled` (DeepSpeed's only switch for it), else None."""
    efficiency = config.data_efficiency
    if not efficiency.data_routing.random_ltd.enabled:
        return None
    if not (efficiency.enabled and efficiency.data_routing.enabled):
        logger.warning("random-LTD is on (data_efficiency.data_routing.random_ltd.enabled=true) although "
                       "data_efficiency.enabled or data_efficiency.data_routing.enabled is false: DeepSpeed reads "
                       "only random_ltd.enabled, and so does zerospeed")
    return RandomLTDScheduler(random_ltd_config(config))


def bind_random_ltd(engine) -> None:
    """DeepSpeed's `engine.random_ltd_initialize()`: bind the wrapped layers of `engine.module` named by
    random_ltd_layer_id to the engine's scheduler."""
    if engine.random_ltd_scheduler is None:
        raise ConfigError("random-LTD layers need data_efficiency.data_routing.random_ltd.enabled=true (with its "
                          "schedule) in the config before convert_to_random_ltd / random_ltd_initialize")
    bind_random_ltd_layers(engine.module, engine.random_ltd_config(), engine.random_ltd_scheduler)


def forward_kwargs(engine) -> dict:
    """The keyword arguments this forward of `engine` adds (Note [forward schedules])."""
    if not engine.module.training:
        return {}
    if engine.random_ltd_scheduler is not None:
        engine.random_ltd_scheduler.update_seq(engine.global_steps)
    out = engine.progressive_layer_drop.get_state() if engine.progressive_layer_drop is not None else {}
    curriculum = engine.curriculum_scheduler_legacy
    if curriculum is not None:
        difficulty = curriculum.update_difficulty(engine.global_steps + 1)
        if engine.config.curriculum_learning.curriculum_type == "seqlen":
            out["curriculum_seqlen"] = difficulty
    return out
