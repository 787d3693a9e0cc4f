"""Caller-managed accumulation (`managed_gradient_accumulation: false`), `coalesce_grad_reduction`'s refusals
and `gradient_allreduce_op`'s accepted values, against DeepSpeed 0.19.8's rules (its engine.py / config.py,
the outputs of its own `DeepSpeedConfig` recorded below) and a plain PyTorch loop. One-process engines; the
2-rank parity runs are tests/dist/test_managed_ga.py."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError, parse_config
from zerospeed.runtime.grad_accumulation import AccumulationWindow

# --- the boundary rule ----------------------------------------------------------------------------


def test_managed_boundary_is_every_gas_th_micro_step_unless_forced():
    w = AccumulationWindow(managed=True)
    assert [w.is_boundary(m, 3) for m in range(6)] == [False, False, True, False, False, True]
    w.set_boundary(True)
    assert w.is_boundary(0, 3)
    w.set_boundary(None)
    assert not w.is_boundary(0, 3)


def test_unmanaged_boundary_is_the_inside_of_step_and_cannot_be_forced():
    w = AccumulationWindow(managed=False)
    assert not any(w.is_boundary(m, 1) for m in range(4))  # even with gradient_accumulation_steps=1
    w.in_step = True
    assert w.is_boundary(0, 4)
    with pytest.raises(AssertionError, match="not supported with managed_gradient_accumulation=false"):
        w.set_boundary(True)


def test_samples_per_step_follow_deepspeed():
    # DeepSpeed: managed adds train_batch_size; unmanaged adds (train_batch_size // gas) per backward since the step
    managed, unmanaged = AccumulationWindow(True), AccumulationWindow(False)
    managed.backwards = unmanaged.backwards = 3
    assert managed.samples(24, 4) == 24
    assert unmanaged.samples(24, 4) == 18 and unmanaged.backwards == 0


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1])
def test_overlap_comm_at_stages_0_1_is_refused_when_unmanaged(stage):
    # DeepSpeed asserts "managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2"
    # (its check is `stage >= 2 or not overlap_comm`)
    raw = {"train_batch_size": 2, "managed_gradient_accumulation": False}
    with pytest.raises(ConfigError, match="overlap_comm=true at ZeRO stage") as info:
        parse_config({**raw, "zero_optimization": {"stage": stage, "overlap_comm": True}})
    assert isinstance(info.value, AssertionError) and "overlap_comm only with ZeRO stage 2" in str(info.value)
    assert not parse_config({**raw, "zero_optimization": {"stage": stage}}).managed_gradient_accumulation
    for ok in (2, 3):  # stage 3's overlap_comm defaults to true
        parse_config({**raw, "zero_optimization": {"stage": ok, "overlap_comm": True}})


# What DeepSpeed 0.19.8's DeepSpeedConfig did with each value (recorded): the accepted value, or its error.
ALLREDUCE_OPS = [
    ({"gradient_allreduce_op": "Mean"}, "mean"),
    ({"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 2}}, "sum"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 1}}, "sum"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "not supported with ZeRO stage 3"),
    ({"gradient_allreduce_op": "avg"}, "Invalid"),
    ({"gradient_allreduce_op": "max"}, "Invalid"),
    ({"gradient_allreduce_op": None}, "Invalid"),
    ({"gradient_allreduce_op": 1}, "Invalid"),
    (
        {
            "gradient_allreduce_op": "sum",
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}},
        },
        "not supported with ZenFlow",
    ),
    ({"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}, "not supported with DeepCompile"),
]


@pytest.mark.parametrize("extra,deepspeed", ALLREDUCE_OPS)
def test_gradient_allreduce_op_accepts_and_refuses_what_deepspeed_does(extra, deepspeed):
    raw = {"train_batch_size": 2, **extra}
    if deepspeed in ("mean", "sum"):
        assert parse_config(raw).gradient_allreduce_op == deepspeed
        return
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    assert message.startswith("gradient_allreduce_op")
    if deepspeed != "Invalid":  # DeepSpeed's sentence, then zerospeed's fix
        assert (
            f"gradient_allreduce_op='sum' is {deepspeed}" in message
            and 'set gradient_allreduce_op to "mean"' in message
        )
    else:
        assert "expected one of 'mean', 'sum'" in message


# --- one-process engines --------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _data(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


UNMANAGED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "managed_gradient_accumulation": False,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


@pytest.mark.parametrize("stage,offload", [(0, None), (1, None), (2, None), (1, "cpu"), (2, "cpu")])
def test_unmanaged_windows_match_plain_pytorch(stage, offload):
    windows = [1, 3, 2]
    zero = {"stage": stage, **({"offload_optimizer": {"device": offload}} if offload else {})}
    engine, *_ = zerospeed.initialize(model=_model(), config={**UNMANAGED, "zero_optimization": zero})
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data, at = _data(sum(windows)), 0
    for k in windows:
        opt.zero_grad()
        for x, y in data[at : at + k]:
            engine.backward(_loss(engine, x, y))
            (_loss(ref, x, y) / 3).backward()  # every backward divides by gradient_accumulation_steps
            assert not engine.is_gradient_accumulation_boundary()
        at += k
        engine.step()
        opt.step()
        assert engine.was_step_applied()
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        assert (a.detach() - b.detach()).abs().max().item() <= 1e-6
    assert engine.global_steps == 3 and engine.global_samples == 2 * sum(windows)


def test_unmanaged_fp16_overflow_skips_the_step_and_says_so():
    config = {
        **UNMANAGED,
        "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zerospeed.initialize(model=_model(), config=config)
    x, y = _data(1)[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(_loss(engine, x.half(), y.half()) * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.loss_scale == 8.0
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    engine.backward(_loss(engine, x.half(), y.half()))
    engine.step()
    assert engine.was_step_applied()


def test_coalesce_refusals_name_deepspeeds_reasons():
    engine, *_ = zerospeed.initialize(model=_model(), config={**UNMANAGED, "zero_optimization": {"stage": 1}})
    with pytest.raises(AssertionError, match="coalesce_grad_reduction is not supported with managed_gradient_acc"):
        with engine.coalesce_grad_reduction():
            pass
    managed = {**UNMANAGED, "managed_gradient_accumulation": True, "zero_optimization": {"stage": 1}}
    engine, *_ = zerospeed.initialize(model=_model(), config=managed)
    x, y = _data(1)[0]
    engine.backward(_loss(engine, x, y))  # a pending gradient: the block would not be one whole window
    with pytest.raises(AssertionError, match="gradients from earlier backward calls are still pending"):
        with engine.coalesce_grad_reduction():
            pass
    engine.zero_grad()
    with pytest.raises(AssertionError, match="step.. inside coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            engine.backward(_loss(engine, x, y))
            engine.step()
    assert not engine.window.coalescing and engine.global_steps == 0


def test_pipeline_refuses_caller_managed_accumulation():
    from zerospeed.pipe import PipelineModule  # DeepSpeed's `deepspeed.pipe`

    torch.manual_seed(0)
    module = PipelineModule(
        layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=1, loss_fn=torch.nn.MSELoss()
    )
    with pytest.raises(ConfigError, match="managed_gradient_accumulation=false is not supported with pipeline") as info:
        zerospeed.initialize(model=module, config=UNMANAGED)
    assert isinstance(info.value, AssertionError)  # DeepSpeed asserts
