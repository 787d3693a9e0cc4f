"""Batch-size resolution: every case of DeepSpeed's rules, and every error, with exact values."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, parse_config, resolve_batch_size


@pytest.mark.parametrize(
    "train,micro,gas,world,expected",
    [
        (32, 4, 4, 2, (32, 4, 4)),  # all three, consistent: 4 * 4 * 2 = 32
        (48, 2, None, 3, (48, 2, 8)),  # train & micro -> gas = 48 / (2 * 3)
        (48, None, 4, 3, (48, 4, 4)),  # train & gas -> micro = 48 / (4 * 3)
        (None, 5, 3, 2, (30, 5, 3)),  # micro & gas -> train = 5 * 3 * 2
        (64, None, None, 8, (64, 8, 1)),  # train only -> gas 1, micro = 64 / 8
        (None, 6, None, 4, (24, 6, 1)),  # micro only -> gas 1, train = 6 * 4
        (1, None, None, 1, (1, 1, 1)),
    ],
)
def test_resolution_cases(train, micro, gas, world, expected):
    assert resolve_batch_size(train, micro, gas, world) == expected


def test_all_three_inconsistent_shows_arithmetic_and_fixes():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(16, 4, 4, 2)
    assert str(info.value) == (
        "train_batch_size 16 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 4 "
        "* data-parallel world size 2 = 32; change them together, e.g. set train_batch_size to 32, "
        "or gradient_accumulation_steps to 2, or train_micro_batch_size_per_gpu to 2; "
        "or give only two of the three and the third is derived"
    )


def test_all_three_inconsistent_without_divisible_alternatives():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(10, 4, 3, 1)
    message = str(info.value)
    assert message.startswith(
        "train_batch_size 10 != train_micro_batch_size_per_gpu 4 * "
        "gradient_accumulation_steps 3 * data-parallel world size 1 = 12;"
    )
    assert "set train_batch_size to 12;" in message
    assert "gradient_accumulation_steps to" not in message and "train_micro_batch_size_per_gpu to" not in message


def test_train_and_micro_not_divisible():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(10, 4, None, 1)
    assert str(info.value) == (
        "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 * data-parallel world size 1 "
        "= 4, so gradient_accumulation_steps cannot be derived; choose train_batch_size as a multiple of 4 "
        "or set gradient_accumulation_steps as well"
    )


def test_train_smaller_than_micro_times_world():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(4, 4, None, 2)
    assert (
        "train_batch_size 4 is not divisible by train_micro_batch_size_per_gpu 4 * data-parallel world "
        "size 2 = 8" in str(info.value)
    )


def test_train_and_gas_not_divisible():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(30, None, 4, 2)
    assert str(info.value).startswith(
        "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 * data-parallel world size 2 = 8, "
        "so train_micro_batch_size_per_gpu cannot be derived"
    )


def test_train_only_not_divisible_by_world():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(10, None, None, 4)
    assert str(info.value).startswith(
        "train_batch_size 10 is not divisible by data-parallel world size 4 = 4, "
        "so train_micro_batch_size_per_gpu cannot be derived"
    )


def test_only_gas_is_an_error():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(None, None, 4, 1)
    assert str(info.value) == (
        "only gradient_accumulation_steps is set; set train_batch_size or "
        "train_micro_batch_size_per_gpu (or both), optionally with gradient_accumulation_steps"
    )


def test_nothing_set_is_an_error():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(None, None, None, 1)
    assert str(info.value).startswith(
        "none of the batch sizes is set; set train_batch_size or train_micro_batch_size_per_gpu"
    )


@pytest.mark.parametrize(
    "args,name,shown",
    [
        ((0, 1, 1, 1), "train_batch_size", "0"),
        ((8, -2, None, 1), "train_micro_batch_size_per_gpu", "-2"),
        ((8, None, 2.0, 1), "gradient_accumulation_steps", "2.0"),
        ((8, None, None, 0), "data-parallel world size", "0"),
        ((True, None, None, 1), "train_batch_size", "True"),
    ],
)
def test_values_must_be_positive_integers(args, name, shown):
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(*args)
    assert str(info.value) == f"{name} must be a positive integer, got {shown}"


def test_auto_note_is_appended():
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(None, None, None, 1, auto_keys=["train_batch_size", "train_micro_batch_size_per_gpu"])
    assert str(info.value).endswith(
        '(train_batch_size, train_micro_batch_size_per_gpu were "auto" and could not be derived from the other '
        "batch keys; set numbers or pass them as known values)"
    )


def test_parse_config_fills_the_model_batch_fields():
    cfg = parse_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (60, 3, 5)


def test_parse_config_rejects_bad_world_size():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 4}, world_size=0)
    assert str(info.value) == "world_size must be a positive integer (the data-parallel world size), got 0"


def test_parse_config_batch_auto_without_value_explains():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": "auto", "gradient_accumulation_steps": 2})
    message = str(info.value)
    assert message.startswith("only gradient_accumulation_steps is set")
    assert 'train_batch_size was "auto" and could not be derived' in message


def test_parse_config_batch_auto_derived_from_the_others():
    cfg = parse_config(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert cfg.train_batch_size == 12
