"""Engine keys of DeepSpeed 0.19.8 checked against its documented behaviour or plain PyTorch: `log_level`,
`disable_python_gc`, `data_types.param_dtype` / `buffer_dtype`, `disable_allgather`,
`zero_optimization.stage3_allgather_sequential`; one process."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

import zerospeed
from harness import reference_train
from zerospeed.runtime.process_settings import PYTHON_GC
from zerospeed.utils.errors import ConfigError

LR = 0.1


class Scaled(nn.Module):
    """A linear model with a floating buffer it reads in forward (as rotary tables are read)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor([1.0 + 2.0**-12, 3.0]))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x) * self.scale, y)


def config(**extra) -> dict:
    return {"train_batch_size": 4, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}} | extra


def engine_for(**extra):
    model = Scaled()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config(**extra))
    return engine


def batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("level, value", [("error", logging.ERROR), ("DEBUG", logging.DEBUG)])
def test_log_level_sets_zerospeeds_logger_like_deepspeeds(level, value):
    log = logging.getLogger("zerospeed")
    before = log.level
    try:
        engine_for(log_level=level).destroy()
        assert log.level == value  # DeepSpeed: set_log_level_from_string(log_level) on its logger
    finally:
        log.setLevel(before)


def test_log_level_unknown_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="log_level='loud'"):
        engine_for(log_level="loud")


def test_disable_python_gc_holds_the_collector_off_until_the_last_engine_is_destroyed():
    assert gc.isenabled()
    a = engine_for(disable_python_gc=True)
    assert not gc.isenabled()
    b = engine_for(disable_python_gc=True)
    assert PYTHON_GC.holders == 2
    assert isinstance(a.collect_python_gc(), int) and not gc.isenabled()
    a.destroy()
    a.destroy()  # a second destroy gives nothing back twice
    assert not gc.isenabled() and PYTHON_GC.holders == 1
    b.destroy()
    assert gc.isenabled() and PYTHON_GC.holders == 0
    engine_for().destroy()  # the default leaves it alone
    assert gc.isenabled()


def test_disable_python_gc_keeps_a_collector_the_user_turned_off():
    gc.disable()
    try:
        engine_for(disable_python_gc=True).destroy()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "extra, ok",
    [
        ({"data_types": {"param_dtype": "fp32"}}, True),
        ({"data_types": {"param_dtype": "bf16"}, "bf16": {"enabled": True}}, True),
        ({"data_types": {"param_dtype": "fp16"}, "fp16": {"enabled": True}}, True),
        ({"data_types": {"param_dtype": "bf16"}}, False),
        ({"data_types": {"param_dtype": "fp16"}, "bf16": {"enabled": True}}, False),
        ({"data_types": {"param_dtype": "fp32"}, "bf16": {"enabled": True}}, False),
    ],
)
def test_param_dtype_may_only_restate_the_precision_mode(extra, ok):
    # DeepSpeed 0.19.8 _assert_valid_mixed_precision_config: param_dtype == the fp16/bf16/fp32 model dtype
    if ok:
        engine_for(**extra).destroy()
    else:
        with pytest.raises(ConfigError, match="data_types.param_dtype=.* conflicts with the precision mode"):
            engine_for(**extra)


def test_buffer_dtype_keeps_buffers_exact_under_bf16():
    original = Scaled().scale.clone()
    kept = engine_for(bf16={"enabled": True}, data_types={"buffer_dtype": "fp32"})
    assert kept.module.lin.weight.dtype == torch.bfloat16
    assert kept.module.scale.dtype == torch.float32
    assert torch.equal(kept.module.scale, original)  # no round trip through bf16 (1 + 2^-12 survives)
    cast = engine_for(bf16={"enabled": True})  # without the key: the whole module in bf16, as before
    assert cast.module.scale.dtype == torch.bfloat16 and cast.module.scale[0].item() == 1.0


def test_buffer_dtype_without_16_bit_casts_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="zerospeed"):
        engine = engine_for(data_types={"buffer_dtype": "bf16"})
    assert engine.module.scale.dtype == torch.float32
    assert "data_types.buffer_dtype='bf16' has no effect without fp16 / bf16" in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        {"disable_allgather": True},
        {"zero_optimization": {"stage": 3, "stage3_allgather_sequential": True}},
        {"zero_optimization": {"stage": 2}, "disable_allgather": True},
    ],
)
def test_accepted_switches_train_like_plain_pytorch(extra):
    engine = engine_for(**extra)
    losses = []
    for x, y in batches():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    model = Scaled()
    ref = reference_train(model, torch.optim.SGD(model.parameters(), lr=LR), batches(), world_size=1, grad_accum=1)
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-5, (losses, ref)
    assert ref[-1] < ref[0]
