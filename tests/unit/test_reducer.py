"""The gradient reducer in one process: with nothing to exchange there is no scaling round trip
and no cast to communication_data_type — stages 0-1 (fp32 accumulation buffers) hand the optimizer
autograd's gradients exactly; stages 2-3 stage each micro-step's gradients in the communication
dtype by design, so theirs are autograd's rounded to bf16 once. Against plain PyTorch gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _config(stage, **over):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "communication_data_type": "bf16",
        "gradient_predivide_factor": 3.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **over,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_gradients_are_autograds_exactly(stage):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)) * 1e3  # values bf16 would round
    ref = _net()
    (ref(x).pow(2).sum()).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    if stage >= 2:
        want = want.bfloat16().float()
    net = _net()
    engine, *_ = zerospeed.initialize(model=net, config=_config(stage))
    engine.backward(engine(x).pow(2).sum())
    engine.zero.finish_reduction()
    expected = float(torch.linalg.vector_norm(want.double()))
    # 1e-6: the stage-0 norm is taken in fp32; a bf16 rounding of the 1e3-scaled gradients is ~4e-3
    assert engine.zero.global_grad_norm() == pytest.approx(expected, rel=1e-6)
    engine.zero.remove_hooks()


def test_offload_keys_at_stage_0_are_refused_by_initialize():
    cfg = _config(0, zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="offload_optimizer.device='cpu' needs ZeRO stage 1, 2 or 3"):
        zerospeed.initialize(model=_net(), config=cfg)
