"""The transformers Trainer's "auto" rules and mismatch check (pure; no processes, no Trainer)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")

from zerospeed.config import ConfigError, parse_config  # noqa: E402
from zerospeed.integrations.hf_auto import check_mismatches, hf_auto_values, hidden_size_of, resolve_hf_config  # noqa: E402

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "configs"


@pytest.fixture(scope="module")
def args():
    return transformers.TrainingArguments(
        output_dir="/tmp/zs-hf-auto",
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        max_grad_norm=0.7,
        learning_rate=2e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.03,
        warmup_steps=0.1,
    )


GPT2 = SimpleNamespace(hidden_size=64)


def _values(args, model_config=GPT2, world=4, total=95):
    return {k: v.value for k, v in hf_auto_values(args, model_config, world, total).items()}


def test_every_auto_rule_gives_the_exact_value(args):
    assert _values(args) == {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 5,
        "train_batch_size": 4 * 3 * 5,
        "gradient_clipping": 0.7,
        "optimizer.params.lr": 2e-4,
        "optimizer.params.betas": [0.8, 0.95],
        "optimizer.params.eps": 1e-7,
        "optimizer.params.weight_decay": 0.03,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 2e-4,
        "scheduler.params.warmup_num_steps": math.ceil(95 * 0.1),  # a ratio of the total: 10
        "scheduler.params.total_num_steps": 95,
        "fp16.enabled": False,
        "bf16.enabled": False,
        "zero_optimization.reduce_bucket_size": 64 * 64,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
        "zero_optimization.stage3_param_persistence_threshold": 640,
    }


def test_warmup_is_at_least_one_step_and_absent_before_the_total_is_known(args):
    no_warmup = transformers.TrainingArguments(output_dir="/tmp/zs-hf-auto", use_cpu=True, report_to=[], warmup_steps=0)
    assert _values(no_warmup)["scheduler.params.warmup_num_steps"] == 1
    before = _values(args, total=None)
    assert "scheduler.params.total_num_steps" not in before and "scheduler.params.warmup_num_steps" not in before


def test_precision_follows_fp16_bf16_and_their_full_eval_variants():
    fake = SimpleNamespace(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        fp16=False,
        fp16_full_eval=True,
        bf16=True,
        bf16_full_eval=False,
    )
    v = _values(fake, total=None)
    assert v["fp16.enabled"] is True and v["bf16.enabled"] is True


def test_hidden_size_from_hidden_size_n_embd_hidden_sizes_or_text_config():
    assert hidden_size_of(transformers.GPT2Config(n_embd=48, n_head=4)) == 48
    assert hidden_size_of(SimpleNamespace(n_embd=32)) == 32
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[32, 96, 64])) == 96
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=80))) == 80
    assert hidden_size_of(SimpleNamespace()) is None and hidden_size_of(None) is None


def test_all_auto_config_resolves_to_the_arguments(args):
    auto = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    cfg = resolve_hf_config(auto, args, GPT2, 4, 95)
    assert "auto" not in json.dumps(cfg)
    assert cfg["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.03}
    assert cfg["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 2e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 95,
    }
    assert cfg["fp16"] == {"enabled": False} and cfg["gradient_clipping"] == 0.7
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 3686
    parsed = parse_config(cfg, world_size=4)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        60,
        3,
        5,
    )


def test_absent_batch_keys_come_from_the_arguments(args):
    cfg = resolve_hf_config({"zero_optimization": {"stage": 2}}, args, GPT2, 2, 10)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        30,
        3,
        5,
    )


def test_six_mismatches_are_raised_as_one_error(args):
    wrong = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 64,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.999]}},
        "fp16": {"enabled": True},
    }
    found = check_mismatches(wrong, args, world_size=4)
    assert found == [
        "ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=3",
        "ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=5",
        "ds train_batch_size=64 vs hf world_size*per_device_train_batch_size*gradient_accumulation_steps=60",
        "ds gradient_clipping=1.0 vs hf max_grad_norm=0.7",
        "ds optimizer.params.betas=[0.9, 0.999] vs hf adam_beta1,adam_beta2=[0.8, 0.95]",
        "ds fp16.enabled=True vs hf fp16|fp16_full_eval=False",
    ]
    with pytest.raises(ConfigError) as err:
        resolve_hf_config(wrong, args, GPT2, 4, 95)
    message = str(err.value)
    assert all(line in message for line in found) and "6 place(s)" in message and '"auto"' in message


def test_agreeing_explicit_values_are_not_mismatches(args):
    agree = {
        "train_micro_batch_size_per_gpu": 3,
        "train_batch_size": 60,
        "gradient_accumulation_steps": 5,
        "gradient_clipping": 0.7,
        "optimizer": {"type": "AdamW", "params": {"betas": (0.8, 0.95)}},
        "fp16": {"enabled": False},
    }
    assert check_mismatches(agree, args, world_size=4) == []


def test_auto_without_a_trainer_value_keeps_the_existing_error(args):
    with pytest.raises(ConfigError, match='zero_optimization.sub_group_size is "auto" but nothing supplies its value'):
        resolve_hf_config({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, args, GPT2, 1, 10)
    # bucket sizes need a hidden size: a model config without one leaves them unresolved
    with pytest.raises(ConfigError, match='zero_optimization.reduce_bucket_size is "auto"'):
        resolve_hf_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, args, None, 1, 10)


@pytest.mark.parametrize("name", ["zero2_cpu_offload_auto.json", "zero3_cpu_offload.json"])
def test_shared_tutorial_configs_resolve(args, name):
    """Everything but the offload sections resolves and validates (offload is checked as a feature)."""
    path = SHARED / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    cfg = resolve_hf_config(str(path), args, GPT2, 2, 100)
    assert "auto" not in json.dumps(cfg)
    parsed = parse_config(cfg, world_size=2, check_features=False)
    assert parsed.train_batch_size == 30 and parsed.train_micro_batch_size_per_gpu == 3
    if name.startswith("zero2"):  # "auto" there; the zero3 fragment has no gradient_clipping (DeepSpeed: none)
        assert parsed.gradient_clipping == 0.7 and parsed.fp16.enabled is False
    else:
        assert parsed.zero_optimization.stage3_prefetch_bucket_size == 3686
        assert parsed.zero_optimization.stage3_param_persistence_threshold == 640


def test_the_integration_imports_without_the_deepspeed_package():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from zerospeed.integrations.transformers import Trainer, TrainingArguments\n"
        "a = TrainingArguments(output_dir='/tmp/zs-hf-auto', deepspeed={'zero_optimization': {'stage': 2}}, "
        "report_to=[])\n"
        "assert a.deepspeed == {'zero_optimization': {'stage': 2}} and a.deepspeed_plugin is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
