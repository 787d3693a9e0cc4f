"""`torch_autocast` and `fp16.auto_cast` (precision/autocast.py, precision/casting.py) in one process:
layouts split by gradient dtype (exact), the refusals DeepSpeed makes (naming the keys), which parameters
travel in the low dtype, the forward's dtype under the engine, the loss scaler's rule, input casting.
The 2-rank training parity is tests/dist/test_torch_autocast.py."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed.precision.casting import cast_floating
from zerospeed.utils.errors import ConfigError
from zerospeed.zero.partition import build_layouts

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


class Recorder(torch.nn.Module):
    """Linear -> LayerNorm; records the dtypes its forward saw and produced."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.seen = []

    def forward(self, x, ids=None):
        h = self.fc(x)
        self.seen.append((x.dtype, h.dtype, None if ids is None else ids.dtype))
        return self.norm(h).float().pow(2).mean()


class MyLinear(torch.nn.Linear):
    pass


def _engine(**sections):
    torch.manual_seed(0)
    model = Recorder()
    engine, *_ = zerospeed.initialize(model=model, config={**BASE, **sections})
    return engine, model


def test_layouts_end_where_the_kind_changes_and_keep_the_bucket_bound():
    # sizes 3, 2, 4, 1, 5 with kinds a, a, b, b, a; bucket 6; world 1, no alignment padding
    got = build_layouts([3, 2, 4, 1, 5], 6, 1, align=1, kinds=["a", "a", "b", "b", "a"])
    assert [[(s.param, s.offset, s.numel) for s in lay.segments] for lay in got] == [
        [(0, 0, 3), (1, 3, 2)],
        [(2, 0, 4), (3, 4, 1)],
        [(4, 0, 5)],
    ]
    got = build_layouts([3, 2, 4], 4, 1, align=1, kinds=["a", "a", "a"])  # the bound still splits one kind
    assert [[s.param for s in lay.segments] for lay in got] == [[0], [1], [2]]
    assert [[s.param for s in lay.segments] for lay in build_layouts([3, 2, 4], 100, 1, align=1)] == [[0, 1, 2]]
    with pytest.raises(ValueError, match="kinds has 2 entries for 3"):
        build_layouts([3, 2, 4], 6, 1, kinds=["a", "b"])


@pytest.mark.parametrize(
    "sections, match",
    [
        ({"torch_autocast": {"enabled": True}, "bf16": {"enabled": True}}, r"torch_autocast.enabled=true and bf16"),
        (
            {"torch_autocast": {"enabled": True, "dtype": "fp16"}, "fp16": {"enabled": True}},
            r"torch_autocast.enabled=true and fp16",
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, r"torch_autocast.dtype='fp32'.*bf16"),
        (
            {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.NoSuchLayer"]}},
            r"lower_precision_safe_modules\[0\] = 'torch.nn.NoSuchLayer': cannot import",
        ),
        (
            {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.float16"]}},
            r"lower_precision_safe_modules\[0\] = 'torch.float16' is not a torch.nn.Module class",
        ),
        (
            {"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            r"zero_quantized_weights",
        ),
    ],
)
def test_deepspeeds_refusals_name_the_keys(sections, match):
    with pytest.raises(ConfigError, match=match):
        _engine(**sections)


def test_low_precision_parameters_are_refused_naming_one():
    model = Recorder().to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"float32 parameters; fc.weight is torch.bfloat16 \(4 such\)"):
        zerospeed.initialize(model=model, config={**BASE, "torch_autocast": {"enabled": True}})


def test_safe_modules_are_exact_classes_from_the_default_list_or_the_config():
    from zerospeed.config import parse_config
    from zerospeed.precision.autocast import (
        get_default_autocast_lower_precision_modules,
        param_comm_dtypes,
    )
    from zerospeed.runtime.plans import precision_policy

    def param_comm_dtypes_of(model, cfg):  # the config's dtype and safe-module list, as the engine's plans read them
        return param_comm_dtypes(
            model, precision_policy(cfg).autocast_dtype, cfg.torch_autocast.lower_precision_safe_modules
        )

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), MyLinear(2, 2), torch.nn.Conv1d(1, 1, 1), torch.nn.LayerNorm(2), torch.nn.Embedding(3, 2)
    )
    on = parse_config({**BASE, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    got = param_comm_dtypes_of(model, on)
    want = {id(p) for i in (0, 2) for p in model[i].parameters()}  # DeepSpeed compares classes exactly
    assert set(got) == want and set(got.values()) == {torch.float16}
    custom = parse_config(
        {
            **BASE,
            "torch_autocast": {
                "enabled": True,
                "lower_precision_safe_modules": [f"{__name__}.MyLinear", "torch.nn.LayerNorm"],
            },
        }
    )
    assert set(param_comm_dtypes_of(model, custom)) == {id(p) for i in (1, 3) for p in model[i].parameters()}
    assert param_comm_dtypes_of(model, parse_config(BASE)) == {}
    assert get_default_autocast_lower_precision_modules() == [
        "torch.nn.modules.linear.Linear",
        "torch.nn.modules.conv.Conv1d",
        "torch.nn.modules.conv.Conv2d",
        "torch.nn.modules.conv.Conv3d",
    ]


def test_the_engine_forward_runs_under_autocast_and_overrides_an_outer_one():
    engine, model = _engine(torch_autocast={"enabled": True})
    x = torch.randn(2, 4)
    engine(x)
    assert model.seen[-1][:2] == (torch.float32, torch.bfloat16)  # the Linear ran in bf16
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() is torch.bfloat16
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.loss_scaler is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    plain, plain_model = _engine()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # DeepSpeed: the engine's own setting wins
        plain(x)
    assert plain_model.seen[-1][:2] == (torch.float32, torch.float32)


def test_fp16_autocast_scales_the_loss_by_torch_gradscalers_rule():
    engine, _ = _engine(torch_autocast={"enabled": True, "dtype": "fp16"})
    s = engine.loss_scaler
    ref = torch.amp.GradScaler("cpu")
    assert s.scale == ref.get_scale() == 2.0**16
    assert (s.scale_window, s.hysteresis, s.scale_factor) == (ref.get_growth_interval(), 1, ref.get_growth_factor())
    s.update(True)  # one overflow halves at once (no hysteresis)
    assert s.scale == 2.0**16 * ref.get_backoff_factor()


def test_fp16_auto_cast_casts_floating_positional_inputs_only():
    engine, model = _engine(fp16={"enabled": True, "auto_cast": True})
    ids = torch.tensor([1, 2])
    engine(torch.randn(2, 4), ids)  # fp32 input, fp16 model: cast
    assert model.seen[-1] == (torch.float16, torch.float16, torch.int64)
    off, _ = _engine(fp16={"enabled": True})
    with pytest.raises(RuntimeError):  # without auto_cast the fp32 input meets fp16 weights, as in DeepSpeed
        off(torch.randn(2, 4))
    nested = cast_floating({"a": [torch.ones(1), (torch.ones(1, dtype=torch.int32), 3)]}, torch.float16)
    assert nested["a"][0].dtype == torch.float16 and nested["a"][1][0].dtype == torch.int32 and nested["a"][1][1] == 3
