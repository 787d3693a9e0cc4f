"""Schedules the engine feeds to the model's forward as keyword arguments, as DeepSpeed's engine does:
the legacy curriculum (`curriculum_learning`: `curriculum_seqlen=`) and progressive layer drop
(`progressive_layer_drop`: `progressive_layer_drop=True, pld_theta=`).

Note [forward schedules]: only a training forward (`module.training`) of the plain engine gets them;
the pipeline engine runs its stages itself and passes none (DeepSpeed's does not either). Before each
such forward the curriculum moves to the difficulty of step `global_steps + 1` (the step this forward
belongs to) and, for `curriculum_type: "seqlen"`, the model receives it as `curriculum_seqlen`. The
layer-drop theta moves at each accumulation boundary, from the step count before the optimizer runs,
so the first step's forwards see theta 1.0. The engine's values replace the caller's keyword arguments
of the same name.
"""
from __future__ import annotations

from zerospeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from zerospeed.runtime.progressive_layer_drop import ProgressiveLayerDrop


def build_forward_schedules(config) -> tuple[CurriculumScheduler | None, ProgressiveLayerDrop | None]:
    """The enabled schedules of a parsed config (None for each one off)."""
    cl, pld = config.curriculum_learning, config.progressive_layer_drop
    curriculum = CurriculumScheduler(cl.model_dump()) if cl.enabled else None
    return curriculum, (ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None)


def forward_kwargs(engine) -> dict:
    """The keyword arguments this forward of `engine` adds (Note [forward schedules])."""
    if not engine.module.training:
        return {}
    out = engine.progressive_layer_drop.get_state() if engine.progressive_layer_drop is not None else {}
    curriculum = engine.curriculum_scheduler_legacy
    if curriculum is not None:
        difficulty = curriculum.update_difficulty(engine.global_steps + 1)
        if engine.config.curriculum_learning.curriculum_type == "seqlen":
            out["curriculum_seqlen"] = difficulty
    return out
