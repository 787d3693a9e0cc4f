"""The transformers Trainer's ``"auto"`` rules and its mismatch check, as pure functions.

A config written for the Trainer says ``"auto"`` where ``TrainingArguments`` (or the model) knows the
value. ``hf_auto_values`` computes every such value from the arguments; ``resolve_auto`` (in
``zerospeed.config.auto``, the one resolver) puts them in. An explicit config value that disagrees
with the arguments would silently train with two different settings (the Trainer scales the loss
by its accumulation, the engine by the config's), so ``check_mismatches`` lists every disagreement
and ``resolve_hf_config`` raises them together as one ``ConfigError``.

Nothing here imports transformers: ``args`` is anything with the ``TrainingArguments`` attributes
used below, ``model_config`` anything with a hidden size, so the rules are tested without a Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from zerospeed.config import AutoValue, ConfigError, auto_values_from_hidden_size, resolve_auto
from zerospeed.config.aliases import apply_aliases
from zerospeed.config.auto import AUTO
from zerospeed.config.loader import load_raw

logger = logging.getLogger(__name__)

__all__ = ["check_mismatches", "hf_auto_values", "hidden_size_of", "load_hf_config", "resolve_hf_config"]


def hidden_size_of(model_config: Any) -> int | None:
    """The model's hidden size: ``hidden_size``, else ``n_embd``, else ``max(hidden_sizes)``; a
    multimodal config's ``text_config`` is searched the same way. None when there is none."""
    if model_config is None:
        return None
    for name in ("hidden_size", "n_embd"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    sizes = getattr(model_config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes:
        return max(sizes)
    return hidden_size_of(getattr(model_config, "text_config", None))


def _batch_values(args: Any, world_size: int) -> dict[str, AutoValue]:
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": AutoValue(micro, "TrainingArguments.per_device_train_batch_size"),
        "gradient_accumulation_steps": AutoValue(gas, "TrainingArguments.gradient_accumulation_steps"),
        "train_batch_size": AutoValue(
            world_size * micro * gas,
            f"world_size {world_size} x per_device_train_batch_size {micro} x gradient_accumulation_steps {gas}",
        ),
    }


def _optimizer_values(args: Any) -> dict[str, AutoValue]:
    return {
        "gradient_clipping": AutoValue(args.max_grad_norm, "TrainingArguments.max_grad_norm"),
        "optimizer.params.lr": AutoValue(args.learning_rate, "TrainingArguments.learning_rate"),
        "optimizer.params.betas": AutoValue(
            [args.adam_beta1, args.adam_beta2], "TrainingArguments.adam_beta1, adam_beta2"
        ),
        "optimizer.params.eps": AutoValue(args.adam_epsilon, "TrainingArguments.adam_epsilon"),
        "optimizer.params.weight_decay": AutoValue(args.weight_decay, "TrainingArguments.weight_decay"),
    }


def _scheduler_values(args: Any, total_steps: int | None) -> dict[str, AutoValue]:
    out = {
        "scheduler.params.warmup_min_lr": AutoValue(0, "the Trainer's rule (not an argument)"),
        "scheduler.params.warmup_max_lr": AutoValue(args.learning_rate, "TrainingArguments.learning_rate"),
    }
    if total_steps is not None:
        out["scheduler.params.total_num_steps"] = AutoValue(total_steps, "the Trainer's number of training steps")
        # Our WarmupLR (like DeepSpeed >= 0.19.6) rejects 0 warm-up steps; transformers clamps to 1 too.
        out["scheduler.params.warmup_num_steps"] = AutoValue(
            max(1, args.get_warmup_steps(total_steps)), "TrainingArguments.get_warmup_steps(total steps)"
        )
    return out


def _precision_values(args: Any) -> dict[str, AutoValue]:
    return {
        "fp16.enabled": AutoValue(bool(args.fp16 or args.fp16_full_eval), "TrainingArguments.fp16 | fp16_full_eval"),
        "bf16.enabled": AutoValue(bool(args.bf16 or args.bf16_full_eval), "TrainingArguments.bf16 | bf16_full_eval"),
    }


def hf_auto_values(args: Any, model_config: Any, world_size: int, total_steps: int | None) -> dict[str, AutoValue]:
    """Every value the Trainer supplies for an ``"auto"`` key, by dotted path, as ``AutoValue``s.

    ``total_steps`` (the number of optimizer steps) is None before it is known; the two scheduler
    keys that need it are then absent. The bucket sizes need the model's hidden size and are absent
    without one (a config that says ``"auto"`` for them then fails in ``resolve_auto``).
    """
    values = {
        **_batch_values(args, world_size),
        **_optimizer_values(args),
        **_scheduler_values(args, total_steps),
        **_precision_values(args),
    }
    hidden = hidden_size_of(model_config)
    if hidden is not None:
        for key, value in auto_values_from_hidden_size(hidden).items():
            values[key] = AutoValue(value, f"hidden size {hidden}")
    return values


# key -> the TrainingArguments name(s) it must agree with, as written in the error
_HF_ARG_NAMES = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world_size*per_device_train_batch_size*gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1,adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.total_num_steps": "max_steps (the number of training steps)",
    "scheduler.params.warmup_num_steps": "warmup_steps (get_warmup_steps)",
    "fp16.enabled": "fp16|fp16_full_eval",
    "bf16.enabled": "bf16|bf16_full_eval",
}


def _lookup(raw: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(config_value: Any, hf_value: Any) -> bool:
    if isinstance(hf_value, list):
        return (
            isinstance(config_value, (list, tuple))
            and len(config_value) == len(hf_value)
            and all(_same(a, b) for a, b in zip(config_value, hf_value))
        )
    if isinstance(hf_value, bool) or isinstance(config_value, bool):
        return config_value is hf_value
    if isinstance(config_value, (int, float)) and isinstance(hf_value, (int, float)):
        return float(config_value) == float(hf_value)
    return config_value == hf_value


def check_mismatches(
    raw_cfg: Mapping[str, Any], args: Any, world_size: int, total_steps: int | None = None
) -> list[str]:
    """Every explicit (not ``"auto"``) config value that disagrees with ``args``, one line each, as
    ``ds <key>=<value> vs hf <arg>=<value>``. Keys absent from the config never mismatch."""
    known = hf_auto_values(args, None, world_size, total_steps)
    out = []
    for key, hf_name in _HF_ARG_NAMES.items():
        present, value = _lookup(raw_cfg, key)
        if not present or value == AUTO or key not in known:
            continue
        hf_value = known[key].value
        if not _same(value, hf_value):
            out.append(f"ds {key}={value!r} vs hf {hf_name}={hf_value!r}")
    return out


def mismatch_error(mismatches: list[str], source: str = "the DeepSpeed config") -> ConfigError:
    """One error listing every disagreement, with the fix."""
    lines = "\n  ".join(mismatches)
    return ConfigError(
        f"{source} disagrees with the TrainingArguments in {len(mismatches)} place(s):\n  {lines}\n"
        'Set these keys to "auto" (the Trainer then fills them) or change the arguments to match.'
    )


def load_hf_config(config: Any) -> dict[str, Any]:
    """The user's config (dict, path or base64 JSON) as a raw dict with DeepSpeed's aliases applied."""
    return apply_aliases(load_raw(config))


def resolve_hf_config(
    config: Any, args: Any, model_config: Any, world_size: int, total_steps: int | None
) -> dict[str, Any]:
    """The config with every Trainer-known ``"auto"`` filled in, after checking that no explicit
    value disagrees with ``args`` (all disagreements are raised together)."""
    raw = load_hf_config(config)
    mismatches = check_mismatches(raw, args, world_size, total_steps)
    if mismatches:
        raise mismatch_error(
            mismatches, f"the DeepSpeed config {config!r}" if isinstance(config, str) else "the DeepSpeed config"
        )
    return resolve_auto(raw, hf_auto_values(args, model_config, world_size, total_steps))
