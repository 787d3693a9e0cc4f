"""Two engine switches, one process: `bf16.check_grad_overflow` (an inf/nan bf16 gradient skips the step, as
fp16's loss scaler does: the weights and optimizer states stay exactly as they were, against a control
without the switch whose weights turn nan) and `dump_state` (the engine's state logged after initialisation)."""

from __future__ import annotations

import logging

import pytest
import torch

import zerospeed

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(**sections):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    engine, *_ = zerospeed.initialize(model=model, config={**BASE, **sections})
    return engine, model


def _step(engine, scale: float) -> None:
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean() * scale
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("stage", [0, 2])
def test_check_grad_overflow_skips_a_bf16_step_with_an_inf_gradient(stage):
    engine, model = _engine(bf16={"enabled": True, "check_grad_overflow": True}, zero_optimization={"stage": stage})
    _step(engine, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(engine, float("inf"))
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.global_steps == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    _step(engine, 1.0)  # and training goes on
    assert engine.was_step_applied() and all(torch.isfinite(v).all() for v in model.state_dict().values())
    control, control_model = _engine(bf16={"enabled": True}, zero_optimization={"stage": stage})
    _step(control, 1.0)
    _step(control, float("inf"))
    assert control.was_step_applied() and not all(torch.isfinite(v).all() for v in control_model.state_dict().values())


def test_dump_state_logs_the_engine_after_initialisation(caplog):
    with caplog.at_level(logging.INFO):
        _engine(dump_state=True, zero_optimization={"stage": 1})
    text = caplog.text
    assert "engine state (dump_state)" in text and "zero_stage: 1" in text and "ShardedStrategy" in text
    assert "'dump_state': True" in text  # the config's non-default keys
