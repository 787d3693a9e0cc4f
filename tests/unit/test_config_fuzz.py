"""Fuzz: random mutations of valid configs either parse or raise ConfigError, never anything else."""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import random
import string
import warnings
from pathlib import Path
from typing import Any

import pytest

from zerospeed.config import ConfigError, ZeroSpeedConfig, auto_values_from_hidden_size, parse_config

HERE = Path(__file__).parent
SHARED_CONFIGS = Path(__file__).parents[2].parent / "shared" / "configs"
MUTATIONS = 400


def _every_key_config() -> dict:
    spec = importlib.util.spec_from_file_location("_schema_samples", HERE / "test_config_schema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.every_key_config()


def base_configs() -> list[dict]:
    configs = [
        {"train_batch_size": 8},
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8, "overlap_comm": True},
        },
        _every_key_config(),
    ]
    for path in sorted(SHARED_CONFIGS.glob("*.json")):
        configs.append(json.loads(path.read_text()))
    return configs


KNOWN_CHOICES: list[dict[str, Any]] = [
    {},
    {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "fp16.enabled": False,
        "bf16.enabled": True,
        **auto_values_from_hidden_size(32),
    },
]

ODD_VALUES: list[Any] = [
    "x",
    "",
    "auto",
    "AUTO",
    1.5,
    -3,
    0,
    2**70,
    1e30,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    [],
    [1, "a"],
    {},
    {"k": {"j": 1}},
    {"enabled": True},
    "cpu",
    "2e8",
    2e8,
]


def dict_nodes(node: Any, path: tuple = ()) -> list[tuple[tuple, dict]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += dict_nodes(value, path + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += dict_nodes(value, path + (index,))
    return found


def misspell(key: str, rng: random.Random) -> str:
    position = rng.randrange(len(key) + 1)
    letter = rng.choice(string.ascii_lowercase + "_")
    edit = rng.choice(["insert", "delete", "replace"]) if key else "insert"
    if edit == "insert":
        return key[:position] + letter + key[position:]
    position = min(position, len(key) - 1)
    if edit == "delete":
        return key[:position] + key[position + 1 :]
    return key[:position] + letter + key[position + 1 :]


def mutate(config: dict, rng: random.Random) -> Any:
    """Apply one random mutation in place (or return a replacement for the whole config)."""
    path, node = rng.choice(dict_nodes(config))
    keys = list(node)
    op = rng.choice(["delete", "insert", "retype", "rename", "nest", "unnest", "retype", "retype"])
    if op == "insert" or not keys:
        node[rng.choice([misspell("enabled", rng), "".join(rng.choices(string.ascii_lowercase, k=6)), "seed"])] = (
            copy.deepcopy(rng.choice(ODD_VALUES))
        )
        return config
    key = rng.choice(keys)
    if op == "delete":
        del node[key]
    elif op == "retype":
        node[key] = copy.deepcopy(rng.choice(ODD_VALUES))
    elif op == "rename":
        node[misspell(str(key), rng)] = node.pop(key)
    elif op == "nest":
        node[key] = rng.choice([{"value": node[key]}, [node[key]], {key: node[key]}])
    else:  # unnest: replace a section by a scalar, or hoist a nested section to the top level
        if isinstance(node[key], dict) and rng.random() < 0.5:
            config[str(key)] = node.pop(key)
        else:
            node[key] = rng.choice([1, "on", True, None])
    if not path and rng.random() < 0.02:
        return rng.choice([[config], "not a config", 17])
    return config


def as_input(config: Any, rng: random.Random) -> Any:
    if isinstance(config, dict) and rng.random() < 0.15:
        return base64.b64encode(json.dumps(config).encode()).decode()
    return config


def test_random_mutations_never_raise_anything_but_config_error():
    rng = random.Random(20240613)
    bases = base_configs()
    outcomes = {"parsed": 0, "rejected": 0}
    for _ in range(MUTATIONS):
        config = copy.deepcopy(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            config = mutate(config, rng) if isinstance(config, dict) else config
        kwargs = {
            "world_size": rng.randint(1, 4),
            "known": rng.choice(KNOWN_CHOICES),
            "check_features": rng.random() < 0.3,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = parse_config(as_input(config, rng), **kwargs)
            except ConfigError as exc:
                message = str(exc)
                assert message and "internal error" not in message, message
                assert "Input should" not in message and "pydantic" not in message, message
                outcomes["rejected"] += 1
                continue
        assert isinstance(result, ZeroSpeedConfig)
        assert all(
            isinstance(v, int)
            for v in (
                result.train_batch_size,
                result.train_micro_batch_size_per_gpu,
                result.gradient_accumulation_steps,
            )
        )
        outcomes["parsed"] += 1
    # Both outcomes must occur, or the fuzzer is not exploring.
    assert outcomes["parsed"] >= 20 and outcomes["rejected"] >= 200, outcomes


@pytest.mark.parametrize("value", ODD_VALUES)
def test_odd_values_at_every_top_level_key(value):
    # Every top-level key gets each odd value; only well-formed ConfigErrors may come out.
    for key in ZeroSpeedConfig.model_fields:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                parse_config({"train_batch_size": 4, key: copy.deepcopy(value)}, check_features=False)
            except ConfigError as exc:
                assert "internal error" not in str(exc), (key, str(exc))


def test_self_referencing_dict_is_rejected_cleanly():
    config: dict = {"train_batch_size": 4, "optimizer": {"params": {}}}
    config["optimizer"]["params"]["me"] = config
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    assert str(info.value) == "config dict refers to itself at optimizer.params.me; a config must be a tree"
