"""The parameter accessors and stage 0's `.grad` view in one process: no double counting when autograd
runs while `.grad` is the buffer's slot, clear errors, and None where DeepSpeed answers None."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.zero.tensor_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _engine(stage, opt=("SGD", {"lr": 0.1}), gas=2, **over):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": opt[0], "params": opt[1]},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **over,
    }
    net = _net()
    engine, *_ = zerospeed.initialize(model=net, config=cfg)
    return engine, net


def _x(seed):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))


def test_stage0_grad_is_a_view_and_autograd_while_attached_counts_once():
    engine, net = _engine(0)
    ref = _net()
    loss1, loss2 = (lambda m: m(_x(1)).pow(2).sum() / 2), (lambda m: m(_x(2)).pow(2).sum() / 2)
    engine.backward(engine(_x(1)).pow(2).sum())
    loss1(ref).backward()
    p = net[0].weight
    assert p.grad is not None and p.grad.data_ptr() == engine.zero._grad_of[id(p)].data_ptr()
    torch.testing.assert_close(p.grad, ref[0].weight.grad)
    # autograd straight into the attached views (no engine.backward): in place, the hook adds nothing
    (net(_x(2)).pow(2).sum() / 2).backward()
    loss2(ref).backward()
    for w, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(engine.zero._grad_of[id(w)], r.grad)
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    with torch.no_grad():
        for w in ref.parameters():
            w -= 0.1 * w.grad
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
        assert a.grad is None
    engine.zero.remove_hooks()


def test_stage0_bf16_accumulates_in_fp32_and_shows_no_grad():
    """A bf16 weight cannot hold an fp32 `.grad`; the accessor answers the fp32 gradient."""
    engine, net = _engine(0, gas=1, bf16={"enabled": True})
    ref = _net()
    ref(_x(1)).pow(2).sum().backward()
    engine.backward(engine(_x(1).bfloat16()).float().pow(2).sum())
    p = net[0].weight
    assert p.grad is None
    g = safe_get_full_grad(p)
    assert g.dtype == torch.float32 and g.shape == p.shape
    torch.testing.assert_close(g, ref[0].weight.grad, rtol=5e-2, atol=5e-2)
    engine.zero.remove_hooks()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_errors_and_none(stage):
    engine, net = _engine(stage, opt=("Adam", {"lr": 1e-2}), gas=1)
    p = net[0].weight
    plain = nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 2.0)
    assert safe_get_full_grad(plain) is plain.grad  # not trained by an engine: DeepSpeed's answer
    assert safe_get_full_fp32_param(plain) is None and safe_get_local_fp32_param(plain) is None
    safe_set_full_fp32_param(plain, torch.zeros(3))  # ignored
    assert torch.equal(plain, torch.ones(3))
    assert safe_get_full_grad(p) is None and safe_get_local_grad(p) is None  # no backward yet
    with pytest.raises(ValueError, match="only available after backward"):
        safe_set_full_grad(p, torch.zeros(7, 5))
    assert engine.zero.optimizer_for_accessors() is engine.optimizer  # the engine binds it
    assert safe_get_full_optimizer_state(p, "exp_avg") is None  # no step yet
    with pytest.raises(RuntimeError, match="first step"):
        safe_set_full_optimizer_state(p, torch.zeros(7, 5), "exp_avg")
    with pytest.raises(ValueError, match="35"):
        safe_set_full_fp32_param(p, torch.zeros(3))
    with pytest.raises(ValueError, match="this rank's piece"):
        safe_set_local_fp32_param(p, torch.zeros(3))
    engine.backward(engine(_x(1)).pow(2).sum())
    assert safe_get_full_grad(p).shape == (7, 5)
    torch.testing.assert_close(safe_get_local_grad(p), safe_get_full_grad(p).reshape(-1))
    engine.step()
    with pytest.raises(ValueError, match="elementwise states are \\['exp_avg', 'exp_avg_sq'\\]"):
        safe_get_full_optimizer_state(p, "step")
    new = torch.arange(35.0).view(7, 5)
    safe_set_full_fp32_param(p, new)
    torch.testing.assert_close(safe_get_full_fp32_param(p), new)
    if stage < 3:  # the model computes with it too
        torch.testing.assert_close(p.detach(), new)
    engine.zero.remove_hooks()
