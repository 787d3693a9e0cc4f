"""The config translated once (runtime/plans.py): each plan's values are written here from the config given
and DeepSpeed's meaning of its keys, not read back from zerospeed; `initialize` logs the plans in one line;
the step hooks (runtime/hooks.py) exist only for the techniques the config enables. One process."""

from __future__ import annotations

import logging

import torch

import zerospeed
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.config import parse_config
from zerospeed.runtime.hooks import CurriculumHook, LayerDropHook
from zerospeed.runtime.plans import build_plans

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _plans(**sections):
    model = _model()
    zerospeed.init_distributed()
    groups = [{"params": list(model.parameters())}]
    return build_plans(
        parse_config({**BASE, **sections}),
        module=model,
        mesh=ParallelMesh.data_parallel(),
        param_groups=groups,
        device=torch.device("cpu"),
    )


def test_the_plans_of_a_stage3_fp16_config():
    plans = _plans(
        fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3, "auto_cast": True},
        zero_optimization={
            "stage": 3,
            "reduce_bucket_size": 1000,
            "zero_quantized_weights": True,
            "stage3_param_persistence_threshold": 7,
        },
        communication_data_type="bf16",
        prescale_gradients=True,
        gradient_clipping=0.5,
    )
    p, z = plans.precision, plans.zero
    assert (p.param_dtype, p.grad_accum_dtype, p.master_dtype) == (torch.float16, torch.float32, torch.float32)
    ls = plans.loss_scale
    assert (ls.static_scale, ls.init_scale, ls.scale_window, ls.hysteresis) == (None, 256.0, 50, 3)
    assert plans.skip_nonfinite and plans.cast_inputs is torch.float16 and plans.gradient_clipping == 0.5
    assert (z.stage, z.reduction.comm_dtype, z.reduction.op, z.reduction.prescale) == (3, torch.bfloat16, "avg", True)
    assert z.zeropp.quantized_weights and z.param_persistence_threshold == 7 and z.mics_shard_size == 0
    assert z.budgets.reduce_bucket == 1000  # below the model bound: the configured size is used
    assert (z.offload.optimizer, z.offload.param) == ("none", "none")
    assert not plans.schedules.any


def test_defaults_are_deepspeeds():
    plans = _plans()
    assert plans.loss_scale is None and not plans.skip_nonfinite and plans.cast_inputs is None
    assert plans.gradient_clipping == 1.0 and plans.zero.stage == 0 and plans.zero.reduction.op == "avg"
    assert plans.zero.reduction.comm_dtype is None and plans.zero.reduction.param_comm_dtypes is None


def test_initialize_logs_the_plans_once(caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed.runtime.plans"):
        zerospeed.initialize(model=_model(), config={**BASE, "zero_optimization": {"stage": 2}})
    lines = [r.getMessage() for r in caplog.records if r.name == "zerospeed.runtime.plans"]
    assert len(lines) == 1 and lines[0].startswith("engine plans: zero stage 2;")


def test_step_hooks_only_for_enabled_techniques():
    engine, *_ = zerospeed.initialize(model=_model(), config=BASE)
    assert engine.step_hooks == [] and engine.progressive_layer_drop is None
    assert engine.curriculum_scheduler_legacy is None and engine.compression_scheduler is None
    curriculum = {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
    }
    engine, *_ = zerospeed.initialize(
        model=_model(),
        config={**BASE, "curriculum_learning": curriculum, "progressive_layer_drop": {"enabled": True, "theta": 0.5}},
    )
    assert [type(h) for h in engine.step_hooks] == [LayerDropHook, CurriculumHook]
    assert engine.progressive_layer_drop is engine.step_hooks[0].scheduler and engine.get_pld_theta() == 1.0
    assert engine.curriculum_scheduler_legacy is engine.step_hooks[1].scheduler
