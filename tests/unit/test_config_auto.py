"""``"auto"`` resolution: from known values, logged; unresolvable keys named; batch keys deferred."""

from __future__ import annotations

import logging

import pytest

from zerospeed.config import AutoValue, ConfigError, auto_values_from_hidden_size, parse_config, resolve_auto


def test_auto_replaced_from_known_anywhere():
    raw = {
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8}},
    }
    known = {
        "gradient_clipping": 1.0,
        "fp16.enabled": True,
        "optimizer.params.lr": 3e-4,
        "optimizer.params.betas": [0.9, 0.999],
        "unused.key": 5,
    }
    assert resolve_auto(raw, known) == {
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8}},
    }


def test_non_auto_values_are_not_overridden_by_known():
    assert resolve_auto({"gradient_clipping": 0.5}, {"gradient_clipping": 1.0}) == {"gradient_clipping": 0.5}


def test_resolve_auto_does_not_modify_its_input():
    raw = {"fp16": {"enabled": "auto"}}
    resolve_auto(raw, {"fp16.enabled": False})
    assert raw == {"fp16": {"enabled": "auto"}}


def test_each_resolution_is_logged_with_its_source(caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed.config.auto"):
        resolve_auto(
            {"optimizer": {"params": {"lr": "auto"}}, "gradient_clipping": "auto"},
            {"optimizer.params.lr": AutoValue(0.001, "TrainingArguments.learning_rate"), "gradient_clipping": 2.0},
        )
    assert "auto: optimizer.params.lr = 0.001 (TrainingArguments.learning_rate)" in caplog.text
    assert "auto: gradient_clipping = 2.0 (supplied)" in caplog.text


def test_unresolvable_auto_names_every_key():
    with pytest.raises(ConfigError) as info:
        resolve_auto({"gradient_clipping": "auto", "zero_optimization": {"reduce_bucket_size": "auto"}}, {})
    assert str(info.value).splitlines() == [
        'gradient_clipping is "auto" but nothing supplies its value here; set a value, '
        "or use the transformers Trainer integration which fills it",
        'zero_optimization.reduce_bucket_size is "auto" but nothing supplies its value here; set a value, '
        "or use the transformers Trainer integration which fills it",
    ]


def test_auto_inside_a_list_is_named_with_its_index():
    with pytest.raises(ConfigError) as info:
        resolve_auto({"optimizer": {"params": {"betas": ["auto", 0.99]}}}, {})
    assert str(info.value).startswith('optimizer.params.betas[0] is "auto"')
    resolved = resolve_auto({"optimizer": {"params": {"betas": ["auto", 0.99]}}}, {"optimizer.params.betas[0]": 0.9})
    assert resolved == {"optimizer": {"params": {"betas": [0.9, 0.99]}}}


def test_batch_auto_keys_are_dropped_when_unknown():
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}
    assert resolve_auto(raw, {"train_micro_batch_size_per_gpu": 2}) == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
    }


def test_absent_batch_keys_are_filled_from_known(caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed.config.auto"):
        out = resolve_auto({"zero_optimization": {"stage": 0}}, {"train_micro_batch_size_per_gpu": 4})
    assert out == {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 4}
    assert "auto: train_micro_batch_size_per_gpu = 4 (supplied; key absent from the config)" in caplog.text


def test_literal_auto_values_are_kept():
    raw = {
        "pipeline": {"stages": "auto"},
        "expert_parallel": {"top_k": "auto", "score_func": "auto"},
        "zero_optimization": {"zenflow": {"select_interval": "auto"}},
    }
    assert resolve_auto(raw, {}) == raw


def test_nested_batch_key_named_like_a_top_level_one_is_not_dropped():
    with pytest.raises(ConfigError) as info:
        resolve_auto({"autotuning": {"max_train_batch_size": "auto"}, "elasticity": {"train_batch_size": "auto"}}, {})
    assert "autotuning.max_train_batch_size" in str(info.value)
    assert "elasticity.train_batch_size" in str(info.value)


def test_hidden_size_rules():
    assert auto_values_from_hidden_size(4096) == {
        "zero_optimization.reduce_bucket_size": 16_777_216,  # 4096 * 4096
        "zero_optimization.stage3_prefetch_bucket_size": 15_099_494,  # int(0.9 * 16777216)
        "zero_optimization.stage3_param_persistence_threshold": 40_960,  # 10 * 4096
    }


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4096"])
def test_hidden_size_must_be_positive_int(bad):
    with pytest.raises(ConfigError) as info:
        auto_values_from_hidden_size(bad)
    assert str(info.value) == f"hidden_size must be a positive integer, got {bad!r}"


def test_parse_config_resolves_hf_style_config():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"},
    }
    known = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16.enabled": True,
        "fp16.enabled": False,
        "optimizer.params.lr": 5e-5,
        "optimizer.params.weight_decay": 0.0,
        **auto_values_from_hidden_size(64),
    }
    cfg = parse_config(config, world_size=2, known=known)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 2)
    assert cfg.bf16_enabled and not cfg.fp16_enabled and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.params == {"lr": 5e-5, "weight_decay": 0.0}
    assert cfg.zero_optimization.reduce_bucket_size == 4096


def test_known_value_of_the_wrong_type_is_a_validation_error():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 2, "gradient_clipping": "auto"}, known={"gradient_clipping": "big"})
    assert str(info.value) == "gradient_clipping: expected a non-negative number, got 'big'"
