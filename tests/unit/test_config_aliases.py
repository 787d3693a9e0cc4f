"""Deprecated and alternative key spellings: each one works and warns; old + new together is an error."""

from __future__ import annotations

import logging
import warnings

import pytest

from zerospeed.config import ConfigError, parse_config
from zerospeed.config.aliases import apply_aliases


def parse(config: dict):
    return parse_config({"train_batch_size": 2, **config}, check_features=False)


def warns_naming(*words: str):
    return pytest.warns(DeprecationWarning, match=".*".join(words))


def test_bfloat16_becomes_bf16():
    with warns_naming("bfloat16", "bf16"):
        cfg = parse({"bfloat16": {"enabled": True}})
    assert cfg.bf16_enabled is True


@pytest.mark.parametrize("flag,stage", [(True, 1), (False, 0)])
def test_bare_bool_zero_optimization(flag: bool, stage: int):
    with warns_naming("zero_optimization", "stage"):
        cfg = parse({"zero_optimization": flag})
    assert cfg.zero_stage == stage


def messages(record) -> list[str]:
    return [str(w.message) for w in record]


def test_allgather_size_feeds_allgather_bucket_size():
    with pytest.warns(DeprecationWarning) as record:
        cfg = parse({"zero_optimization": True, "allgather_size": 3e8})
    assert cfg.zero_optimization.allgather_bucket_size == 300_000_000
    assert messages(record) == [
        'config key zero_optimization: true is deprecated; use zero_optimization: {"stage": 1} instead '
        "(applied automatically)",
        "config key allgather_size is deprecated; use zero_optimization.allgather_bucket_size instead "
        "(applied automatically)",
    ]


def test_warning_points_at_the_callers_file():
    with pytest.warns(DeprecationWarning) as record:
        parse({"bfloat16": {"enabled": False}})
    assert record[0].filename == __file__


def test_cpu_offload_true_means_cpu_optimizer_offload():
    with warns_naming("zero_optimization.cpu_offload", "offload_optimizer"):
        cfg = parse({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is False


def test_cpu_offload_false_means_no_offload():
    with warns_naming("cpu_offload"):
        cfg = parse({"zero_optimization": {"cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer is None


def test_cpu_offload_param_means_cpu_param_offload():
    with warns_naming("zero_optimization.cpu_offload_param", "offload_param"):
        cfg = parse({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert cfg.zero_optimization.offload_param.device == "cpu"


def test_cpu_offload_use_pin_memory_sets_both_sections():
    with pytest.warns(DeprecationWarning) as record:
        cfg = parse(
            {"zero_optimization": {"cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}}
        )
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert cfg.zero_optimization.offload_param.pin_memory is True
    assert messages(record)[2] == (
        "config key zero_optimization.cpu_offload_use_pin_memory is deprecated; use "
        "zero_optimization.offload_optimizer.pin_memory and zero_optimization.offload_param.pin_memory instead "
        "(applied automatically)"
    )


def test_cpu_offload_use_pin_memory_applies_to_explicit_sections():
    with warns_naming("cpu_offload_use_pin_memory"):
        cfg = parse({"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert cfg.zero_optimization.offload_param is None


def test_cpu_offload_use_pin_memory_alone_has_no_effect_but_warns():
    with warns_naming("cpu_offload_use_pin_memory", "no effect"):
        cfg = parse({"zero_optimization": {"cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_optimizer is None


def test_stage3_gather_fp16_weights_renamed():
    with warns_naming("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"):
        cfg = parse({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_deprecation_is_also_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="zerospeed.config.aliases"), warns_naming("bfloat16"):
        parse({"bfloat16": {"enabled": False}})
    assert "config key bfloat16 is deprecated; use bf16 instead" in caplog.text


def test_field_name_spellings_are_accepted_without_deprecation(caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.INFO, logger="zerospeed.config.aliases"):
            cfg = parse(
                {
                    "zero_optimization": {"prefetch_bucket_size": 1e6, "max_live_parameters": 7},
                    "tensor_parallel": {"tensor_parallel": {"tp_size": 4}, "replace_with_kernel_inject": True},
                }
            )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1_000_000
    assert cfg.zero_optimization.stage3_max_live_parameters == 7
    assert cfg.tensor_parallel.tp.tp_size == 4 and cfg.tensor_parallel.kernel_inject is True
    assert (
        "zero_optimization.prefetch_bucket_size is read as zero_optimization.stage3_prefetch_bucket_size" in caplog.text
    )


@pytest.mark.parametrize(
    "config,old,new",
    [
        ({"bfloat16": {}, "bf16": {}}, "bfloat16", "bf16"),
        (
            {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.cpu_offload",
            "zero_optimization.offload_optimizer",
        ),
        (
            {"zero_optimization": {"cpu_offload_param": False, "offload_param": {}}},
            "zero_optimization.cpu_offload_param",
            "zero_optimization.offload_param",
        ),
        (
            {"zero_optimization": {"offload_param": {"pin_memory": False}, "cpu_offload_use_pin_memory": True}},
            "zero_optimization.cpu_offload_use_pin_memory",
            "zero_optimization.offload_param.pin_memory",
        ),
        (
            {
                "zero_optimization": {
                    "stage3_gather_fp16_weights_on_model_save": True,
                    "stage3_gather_16bit_weights_on_model_save": False,
                }
            },
            "zero_optimization.stage3_gather_fp16_weights_on_model_save",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
        (
            {"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}},
            "zero_optimization.prefetch_bucket_size",
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        (
            {"allgather_size": 10, "zero_optimization": {"allgather_bucket_size": 5}},
            "allgather_size",
            "zero_optimization.allgather_bucket_size",
        ),
    ],
)
def test_alias_with_its_replacement_is_an_error(config, old, new):
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parse(config)
    assert str(info.value) == f"{old} and {new} are both given; {old} is another spelling of {new}, so keep only {new}"


def test_non_bool_cpu_offload_is_an_error():
    with pytest.raises(ConfigError) as info:
        parse({"zero_optimization": {"cpu_offload": "yes"}})
    assert str(info.value) == "zero_optimization.cpu_offload: expected true or false, got 'yes'"


def test_apply_aliases_does_not_modify_its_input():
    raw = {"bfloat16": {"enabled": True}, "zero_optimization": {"cpu_offload": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = apply_aliases(raw)
    assert raw == {"bfloat16": {"enabled": True}, "zero_optimization": {"cpu_offload": True}}
    assert out == {"bf16": {"enabled": True}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
