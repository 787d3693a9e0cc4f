"""The fp16 loss scaler state machine: exact scale sequences for given overflow patterns."""

import types

import pytest

from zerospeed.precision import (
    DynamicLossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    loss_scaler_from_config,
)
from zerospeed.utils.errors import ConfigError

T, F = True, False
S = 1024.0


def run(scaler, pattern):
    scales = []
    for overflow in pattern:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_window2_hysteresis2_exact_sequence():
    # Walked by hand: it0 clean (1 clean step, window 2: no growth); it1 grows, budget refilled;
    # it2 overflow spends one unit of hysteresis (2 -> 1); it3 clean, 1 step since overflow;
    # it4 overflow with budget 1 halves; it5 halves again; it6 clean (1 since overflow);
    # it7 clean (2 since overflow) grows; it8 clean (3 since): no growth.
    scaler = DynamicLossScaler(init_scale=S, scale_window=2, hysteresis=2)
    got = run(scaler, [F, F, T, F, T, T, F, F, F])
    assert got == [S, 2 * S, 2 * S, 2 * S, S, S / 2, S / 2, S, S]


def test_consecutive_hysteresis_refills_after_every_clean_step():
    # Same pattern: the clean step at it3 refills the budget, so the overflow at it4 only spends
    # hysteresis again and the scale drops once (at it5) instead of twice.
    scaler = DynamicLossScaler(init_scale=S, scale_window=2, hysteresis=2, consecutive_hysteresis=True)
    got = run(scaler, [F, F, T, F, T, T, F, F, F])
    assert got == [S, 2 * S, 2 * S, 2 * S, 2 * S, S, S, 2 * S, 2 * S]


def test_without_consecutive_hysteresis_budget_only_refills_on_growth():
    # Overflow, clean, overflow: with no growth in between, the second overflow drops the scale.
    off = DynamicLossScaler(init_scale=S, scale_window=10, hysteresis=2)
    on = DynamicLossScaler(init_scale=S, scale_window=10, hysteresis=2, consecutive_hysteresis=True)
    assert run(off, [T, F, T]) == [S, S, S / 2]
    assert run(on, [T, F, T]) == [S, S, S]


def test_hysteresis_one_drops_on_every_overflow_and_grows_after_window():
    scaler = DynamicLossScaler(init_scale=S, scale_window=3, hysteresis=1)
    got = run(scaler, [T, T, F, F, F, F, F, F])
    # Clean steps after the last overflow (it1): it2, it3, it4 -> grows at it4; it7 again.
    assert got == [S / 2, S / 4, S / 4, S / 4, S / 2, S / 2, S / 2, S]


def test_growth_counted_from_start_without_overflow():
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=3, hysteresis=2)
    assert run(scaler, [F] * 7) == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_scale_is_clamped_at_min_scale_without_error():
    scaler = DynamicLossScaler(init_scale=8.0, min_scale=3.0, hysteresis=1, raise_error_at_min_scale=False)
    assert run(scaler, [T, T, T]) == [4.0, 3.0, 3.0]


def test_overflow_at_min_scale_raises_clear_error():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0, hysteresis=1)
    scaler.update(True)
    assert scaler.scale == 1.0
    with pytest.raises(LossScaleUnderflowError) as info:
        scaler.update(True)
    msg = str(info.value)
    assert "already at its minimum 1.0" in msg
    assert "inf/nan" in msg and "bf16" in msg and "learning rate" in msg
    assert isinstance(info.value, RuntimeError)


def test_hysteresis_spent_before_min_scale_error():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, hysteresis=2)
    scaler.update(True)  # spends hysteresis, no drop requested yet
    assert scaler.scale == 1.0
    with pytest.raises(LossScaleUnderflowError):
        scaler.update(True)


def test_state_dict_round_trip_continues_identically():
    pattern_a = [F, T, F, F, T]
    pattern_b = [T, F, F, F, T, T, F, F, F, F]
    ref = DynamicLossScaler(init_scale=S, scale_window=3, hysteresis=2)
    run(ref, pattern_a)
    saved = ref.state_dict()
    assert saved == {
        "dynamic": True,
        "scale": ref.scale,
        "cur_iter": 5,
        "last_overflow_iter": 4,
        "cur_hysteresis": ref.cur_hysteresis,
    }
    resumed = DynamicLossScaler(init_scale=1.0, scale_window=3, hysteresis=2)
    resumed.load_state_dict(dict(saved))
    assert run(resumed, pattern_b) == run(ref, pattern_b)


def test_load_static_state_into_dynamic_fails_loudly():
    with pytest.raises(ValueError, match="static loss scaler"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8.0).state_dict())


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128.0)
    assert scaler.dynamic is False
    assert run(scaler, [T, F, T, T]) == [128.0] * 4
    scaler.load_state_dict({"dynamic": False, "scale": 4.0})
    assert scaler.scale == 128.0  # configuration wins over the checkpoint


def test_from_config_dynamic_and_static():
    dyn = loss_scaler_from_config(
        types.SimpleNamespace(
            loss_scale=0,
            initial_scale_power=5,
            loss_scale_window=7,
            hysteresis=3,
            consecutive_hysteresis=True,
            min_loss_scale=0.5,
        )
    )
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic is True
    assert (dyn.scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale) == (32.0, 7, 3, 0.5)
    assert dyn.consecutive_hysteresis is True and dyn.scale_factor == 2.0
    static = loss_scaler_from_config(types.SimpleNamespace(loss_scale=64))
    assert isinstance(static, StaticLossScaler) and static.scale == 64.0


def test_from_config_defaults_are_deepspeeds():
    dyn = loss_scaler_from_config(types.SimpleNamespace(loss_scale=0))
    assert (dyn.scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale) == (65536.0, 1000, 2, 1.0)
    assert dyn.consecutive_hysteresis is False


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"scale_window": 0}, "fp16.loss_scale_window"),
        ({"min_scale": 0.0}, "fp16.min_loss_scale"),
        ({"init_scale": 0.0}, "fp16.initial_scale_power"),
        ({"scale_factor": 1.0}, "scale factor"),
    ],
)
def test_bad_dynamic_args_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        DynamicLossScaler(**kwargs)


def test_bad_static_scale():
    with pytest.raises(ConfigError, match="fp16.loss_scale"):
        StaticLossScaler(-1.0)
