"""zerospeed.elasticity: DeepSpeed's compute_elastic_config as pure functions of integers, and the engine's
batch sizes from the elasticity block.

Expected values are DeepSpeed's documented ones (its tests/unit/elasticity/test_elastic.py: 9792 with 23
GPU counts, micro batch 17 at 64 GPUs, 24/3 at 4 GPUs, <= 100 under #8237) or derived by hand in the
comments; the rest were computed once by DeepSpeed's own elasticity code (deepspeed/elasticity, at the
commit that keeps the batch within max_train_batch_size) and written here as literals. No DeepSpeed import.
"""

from __future__ import annotations

import json
import logging

import pytest

from zerospeed.config import ConfigError, parse_config
from zerospeed.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    constants,
    elastic_batch,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from zerospeed.elasticity.elasticity import (
    _get_compatible_gpus_v02,
    get_best_candidates,
    get_candidate_batch_sizes,
    get_valid_gpus,
)

DS_VERSION = "0.19.8"
DOC_1680_GPUS = [
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    10,
    12,
    14,
    15,
    20,
    21,
    24,
    28,
    30,
    35,
    40,
    42,
    56,
    60,
    70,
    84,
    105,
    120,
    140,
    168,
    210,
    280,
    420,
    840,
]


def ds_10k(**changes) -> dict:
    """DeepSpeed's test fixture."""
    block = {
        "enabled": True,
        "max_train_batch_size": 10000,
        "micro_batch_sizes": [8, 12, 16, 17],
        "min_gpus": 32,
        "max_gpus": 1500,
        "min_time": 20,
        "version": 0.1,
    }
    return {"elasticity": {**block, **changes}}


def doc_2000(**changes) -> dict:
    """The example of DeepSpeed's elasticity docstring and constants (FORMAT)."""
    block = {
        "enabled": True,
        "max_train_batch_size": 2000,
        "micro_batch_sizes": [2, 4, 6],
        "min_gpus": 1,
        "max_gpus": 10000,
        "min_time": 20,
        "version": 0.1,
    }
    return {"elasticity": {**block, **changes}}


# --- the building blocks, by hand -----------------------------------------------------------------


def test_candidates_scale_each_base_by_the_largest_fitting_hcn():
    # 2000 // 2 = 1000 -> HCN 840 -> 1680; 2000 // 4 = 500 -> 360 -> 1440; 2000 // 6 = 333 -> 240 -> 1440;
    # lcm 12: 166 -> 120 -> 1440
    assert get_candidate_batch_sizes([2, 4, 6, 12], 2000) == [1440, 1680]
    # a base equal to the maximum stays; one above it is dropped (DeepSpeed #8237)
    assert get_candidate_batch_sizes([8, 10, 12, 120], 100) == [60, 72, 96]
    assert get_candidate_batch_sizes([100], 100) == [100]


def test_valid_gpus_are_divisors_of_batch_over_a_micro_batch():
    # 12 / 2 = 6 -> {1, 2, 3, 6}; 12 / 3 = 4 -> {1, 2, 4}
    assert get_valid_gpus(12, [2, 3], 1, 100) == [1, 2, 3, 4, 6]
    assert get_valid_gpus(12, [2, 3], 2, 4) == [2, 3, 4]
    assert get_valid_gpus(12, [5], 1, 100) == []


def test_best_candidate_has_most_gpu_counts_and_ties_follow_prefer_larger():
    # 8 with [2]: 4 -> {1, 2, 4}; 6 with [2]: 3 -> {1, 3}; 8 and 16 tie at [1, 2] under max_gpus 2
    assert get_best_candidates([6, 8], [2], 1, 100, True) == (8, [1, 2, 4])
    assert get_best_candidates([8, 16], [2], 1, 2, True) == (16, [1, 2])
    assert get_best_candidates([8, 16], [2], 1, 2, False) == (8, [1, 2])
    # nothing valid: ties at zero counts against the start (the smallest micro batch, [])
    assert get_best_candidates([7], [2], 1, 2, True) == (7, [])
    assert get_best_candidates([7], [2], 1, 2, False) == (2, [])


# --- compute_elastic_config: DeepSpeed's documented results -----------------------------------------


def test_basic_10k():
    batch, gpus = compute_elastic_config(ds_10k(), DS_VERSION)
    assert (batch, len(gpus)) == (9792, 23)
    for n in gpus:
        assert batch % n == 0 and any(batch // n % m == 0 for m in (8, 12, 16, 17))


def test_valid_world_size_gives_the_largest_dividing_micro_batch():
    assert compute_elastic_config(ds_10k(), DS_VERSION, world_size=64)[2] == 17


def test_invalid_world_size():
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 128 is not valid"):
        compute_elastic_config(ds_10k(), DS_VERSION, world_size=128)


def test_docs_example_2000():
    assert compute_elastic_config(doc_2000(), DS_VERSION) == (1680, DOC_1680_GPUS)
    assert compute_elastic_config(doc_2000(), DS_VERSION, world_size=8) == (1680, DOC_1680_GPUS, 6)  # 210 = 6 * 35
    assert compute_elastic_config(doc_2000(version=0.2), DS_VERSION, world_size=8) == (1680, DOC_1680_GPUS, 6)


def test_proper_micro_batch_and_batch_within_max():
    config = ds_10k(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1)
    batch, gpus, micro = compute_elastic_config(config, DS_VERSION, world_size=4)
    assert (batch, gpus, micro) == (24, [1, 2, 3, 4, 6, 8, 12, 24], 3)  # lcm 42 > 32 is no candidate
    batch, _ = compute_elastic_config(
        ds_10k(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12], min_gpus=1), DS_VERSION
    )
    assert batch == 96  # DeepSpeed before #8237: the unscaled lcm 120


def test_prefer_larger_batch():
    def batch(prefer: bool, micro: list[int]) -> tuple:
        return compute_elastic_config(
            ds_10k(
                max_train_batch_size=24, micro_batch_sizes=micro, min_gpus=1, max_gpus=10000, prefer_larger_batch=prefer
            ),
            DS_VERSION,
        )

    assert batch(True, [7, 11]) == (22, [1, 2]) and batch(False, [7, 11]) == (14, [1, 2])
    assert batch(True, [8, 9]) == (18, [1, 2]) and batch(False, [8, 9]) == (16, [1, 2])


def test_version_02_nodes_and_model_parallel():
    config = doc_2000(version=0.2, num_gpus_per_node=8, model_parallel_size=2)
    batch, dp_sizes, micro = compute_elastic_config(config, DS_VERSION, world_size=16)
    # per node 4 data-parallel ranks: 0.1 over nodes with max 2000 // 4 = 500 gives 480, times 4
    assert (batch, micro) == (1920, 6)
    assert dp_sizes == [4, 8, 12, 16, 20, 24, 32, 40, 48, 60, 64, 80, 96, 120, 160, 192, 240, 320, 480, 960]


def test_version_02_model_parallel_from_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    config = ds_10k(version=0.2, model_parallel_size=4, num_gpus_per_node=8)
    assert compute_elastic_config(config, DS_VERSION) == (9996, [4])  # the fallback: 16 GPUs = 4 replicas
    assert compute_elastic_config(config, DS_VERSION, return_microbatch=True) == (9996, [4], 16)


def test_version_02_fallback_off_the_plan():
    # 7 GPUs is not planned (max_gpus 4): the largest multiple of micro * 7 within 100 is 84 = 3 * 4 * 7
    config = ds_10k(version=0.2, max_train_batch_size=100, micro_batch_sizes=[3, 5], min_gpus=1, max_gpus=4)
    assert compute_elastic_config(config, DS_VERSION, world_size=7) == (84, [7], 3)
    config["elasticity"]["prefer_larger_batch"] = False  # the smallest: 70 = 5 * 2 * 7
    assert compute_elastic_config(config, DS_VERSION, world_size=7) == (70, [7], 5)
    assert _get_compatible_gpus_v02([3, 5], 100, 7, 1, 4, True) == (84, [7], 3)


def test_version_02_never_returns_batch_zero(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")  # 4 replicas x micro 3 = 12 > 8 (DeepSpeed returns batch 0)
    config = ds_10k(
        version=0.2,
        max_train_batch_size=8,
        micro_batch_sizes=[3],
        min_gpus=1,
        max_gpus=10000,
        num_gpus_per_node=4,
        model_parallel_size=4,
    )
    with pytest.raises(ElasticityIncompatibleWorldSize, match="exceeds elasticity.max_train_batch_size 8"):
        compute_elastic_config(config, DS_VERSION)


def test_version_02_needs_a_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="needs the current world size"):
        compute_elastic_config(ds_10k(version=0.2), DS_VERSION)


# --- compute_elastic_config: DeepSpeed's errors --------------------------------------------------------


@pytest.mark.parametrize(
    "config, target, error, match",
    [
        (ds_10k(), "0.2", ElasticityError, "needs DeepSpeed 0.3.8 or newer"),
        (ds_10k(enabled=False), DS_VERSION, ElasticityConfigError, "elasticity.enabled is false"),
        (ds_10k(version=0.3), DS_VERSION, ElasticityConfigError, "newer than the newest elasticity version"),
        (ds_10k(version="0.3"), DS_VERSION, ElasticityConfigError, "elasticity.version: expected a number"),
        (ds_10k(version=0.15), DS_VERSION, ElasticityConfigError, "not an elasticity version"),
        (
            {"elasticity": {"enabled": True}},
            DS_VERSION,
            ElasticityConfigError,
            "elasticity.max_train_batch_size and elasticity.micro_batch_sizes missing",
        ),
        ({}, DS_VERSION, ElasticityConfigError, "has no 'elasticity' block"),
        (
            ds_10k(model_parallel_size=4, num_gpus_per_node=8),
            DS_VERSION,
            ElasticityConfigError,
            "does not support model parallelism",
        ),
        (
            ds_10k(micro_batch_sizes=[1, 4, -1, 2, -10]),
            DS_VERSION,
            ElasticityConfigError,
            "must list positive integers",
        ),
        (ds_10k(micro_batch_sizes=[]), DS_VERSION, ElasticityConfigError, "must list positive integers"),
        (ds_10k(micro_batch_sizes=5), DS_VERSION, ElasticityConfigError, "micro_batch_sizes: expected a list"),
        (ds_10k(micro_batch_sizes=["a", None, 0.5]), DS_VERSION, ElasticityConfigError, "expected a list of integers"),
        (ds_10k(micro_batch_sizes=[2, 0.5, 4]), DS_VERSION, ElasticityConfigError, "expected a list of integers"),
        (ds_10k(min_gpus=-1), DS_VERSION, ElasticityConfigError, "elasticity.min_gpus: expected a positive integer"),
        (ds_10k(max_gpus=-1), DS_VERSION, ElasticityConfigError, "elasticity.max_gpus: expected a positive integer"),
        (ds_10k(min_gpus=64, max_gpus=32), DS_VERSION, ElasticityConfigError, "min_gpus 64 is greater than"),
        (ds_10k(min_time=-1), DS_VERSION, ElasticityConfigError, "elasticity.min_time: expected a non-negative"),
        (ds_10k(prefer_large_batch=True), DS_VERSION, ElasticityConfigError, "did you mean prefer_larger_batch"),
        (ds_10k(max_train_batch_size=4), DS_VERSION, ElasticityConfigError, "exceed max_train_batch_size 4"),
    ],
)
def test_errors(config, target, error, match):
    with pytest.raises(error, match=match):
        compute_elastic_config(config, target)


def test_model_parallel_must_divide_gpus_per_node():
    config = ds_10k(version=0.2, model_parallel_size=16, num_gpus_per_node=8)
    with pytest.raises(ElasticityError, match="num_gpus_per_node \\(8\\) to be divisible"):
        compute_elastic_config(config, DS_VERSION, world_size=16)


def test_errors_are_config_errors_and_value_errors():
    """Note [elasticity errors are config errors]: DeepSpeed raises ValueError for these two."""
    for bad in ("not a dict", ds_10k(max_train_batch_size=4)):
        with pytest.raises(ElasticityConfigError) as info:
            compute_elastic_config(bad, DS_VERSION)
        assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)


def test_version_01_micro_batch_needs_a_world_size():
    with pytest.raises(ElasticityConfigError, match="pass world_size > 0"):
        compute_elastic_config(ds_10k(), DS_VERSION, return_microbatch=True)


def test_deterministic():
    assert compute_elastic_config(ds_10k(), DS_VERSION) == compute_elastic_config(ds_10k(), DS_VERSION)


# --- the rest of DeepSpeed's module -------------------------------------------------------------------


def test_elasticity_enabled():
    assert elasticity_enabled(ds_10k()) and not elasticity_enabled(ds_10k(enabled=False))
    assert not elasticity_enabled({}) and not elasticity_enabled({"elasticity": {}})


def test_config_object_has_deepspeeds_attribute_names_and_defaults():
    config = ElasticityConfig({"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]})
    assert (config.max_acceptable_batch_size, config.micro_batches, config.prefer_larger_batch_size) == (
        64,
        [2, 4],
        True,
    )
    assert (config.min_gpus, config.max_gpus, config.min_time, config.version) == (1, 10000, 0, 0.2)
    assert (config.model_parallel_size, config.num_gpus_per_node, config.ignore_non_elastic_batch_info) == (1, 1, False)
    assert json.loads(repr(config))["micro_batches"] == [2, 4]
    disabled = ElasticityConfig({})  # disabled: DeepSpeed's defaults fill the batch keys
    assert (disabled.enabled, disabled.max_acceptable_batch_size, disabled.micro_batches) == (False, 2000, [2, 4, 6])
    assert (constants.MIN_TIME_DEFAULT, constants.VERSION_DEFAULT, constants.LATEST_ELASTICITY_VERSION) == (0, 0.2, 0.2)


def test_scheduler_config_must_match(monkeypatch):
    runtime = ds_10k()["elasticity"]
    monkeypatch.delenv(constants.DEEPSPEED_ELASTICITY_CONFIG, raising=False)
    ensure_immutable_elastic_config(runtime)  # nothing to compare against
    monkeypatch.setenv(constants.DEEPSPEED_ELASTICITY_CONFIG, json.dumps(runtime))
    ensure_immutable_elastic_config(runtime)
    monkeypatch.setenv(constants.DEEPSPEED_ELASTICITY_CONFIG, json.dumps(ds_10k(max_train_batch_size=27)))
    with pytest.raises(
        ElasticityConfigError,
        match="max_train_batch_size is 10000 in this job's config but the resource scheduler planned with 27",
    ):
        ensure_immutable_elastic_config(runtime)


# --- the engine's batch sizes --------------------------------------------------------------------------

ELASTIC = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 2}


def test_elastic_batch_keeps_the_global_batch_by_changing_accumulation():
    # 8 // 2 = 4 -> HCN 4 -> 8; 8 / 2 = 4 has divisors {1, 2, 4}, max_gpus 2 leaves [1, 2]
    config = ElasticityConfig(ELASTIC)
    assert [
        (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps)
        for b in (elastic_batch(config, 2), elastic_batch(config, 1))
    ] == [(8, 2, 2), (8, 2, 4)]
    assert elastic_batch(config, 2).valid_world_sizes == (1, 2) and not elastic_batch(config, 2).fallback
    with pytest.raises(ElasticityIncompatibleWorldSize):
        elastic_batch(ElasticityConfig({**ELASTIC, "version": 0.1}), 3)
    assert elastic_batch(config, 3).fallback  # version 0.2: 6 = 2 * 3 at three ranks only


def test_elastic_batch_plans_version_02_at_dp_times_model_parallel():
    """Note [elastic world size]: 8 data-parallel ranks of a 2-way model-parallel model are 16 GPUs."""
    config = ElasticityConfig(doc_2000(version=0.2, num_gpus_per_node=8, model_parallel_size=2)["elasticity"])
    plan = elastic_batch(config, 8)
    assert (plan.train_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps) == (1920, 6, 40)


@pytest.mark.parametrize("world, expected", [(1, (8, 2, 4)), (2, (8, 2, 2))])
def test_parse_config_takes_batch_sizes_from_the_block(world, expected):
    cfg = parse_config({"elasticity": ELASTIC}, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_parse_config_refuses_batch_keys_outside_the_block(key):
    with pytest.raises(ElasticityConfigError) as info:
        parse_config({key: 2, "elasticity": ELASTIC}, world_size=2)
    assert str(info.value).startswith(f"{key} set outside the elasticity block")
    assert "elasticity.ignore_non_elastic_batch_info: true" in str(info.value)


def test_parse_config_ignores_batch_keys_when_told(caplog):
    config = {
        "train_batch_size": 6,
        "gradient_accumulation_steps": 3,
        "elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True},
    }
    with caplog.at_level(logging.WARNING, logger="zerospeed.elasticity.elasticity"):
        cfg = parse_config(config, world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 2)
    assert "overriding train_batch_size from the config with 8" in caplog.text
    assert "overriding gradient_accumulation_steps from the config with 2" in caplog.text


def test_parse_config_world_size_outside_the_plan():
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 3 is not valid"):
        parse_config({"elasticity": {**ELASTIC, "version": 0.1}}, world_size=3)


def test_disabled_block_changes_nothing():
    cfg = parse_config({"train_batch_size": 6, "elasticity": {"max_train_batch_size": 4}}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (6, 3, 1)
