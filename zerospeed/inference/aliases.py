"""DeepSpeed's other spellings of inference keys, rewritten on the raw dict before validation.

Two kinds, as in DeepSpeed 0.19: aliases (``tp`` for ``tensor_parallel``, ``max_tokens`` for
``max_out_tokens``, ...), accepted silently; and deprecated top-level keys that moved into a section
(``mp_size`` -> ``tensor_parallel.tp_size``, ``ep_size`` -> ``moe.ep_size``, ...), accepted with a
DeprecationWarning. Giving both spellings of one setting is an error naming both: which one wins would
otherwise be an accident of dict order.
"""

from __future__ import annotations

import warnings
from typing import Any

from zerospeed.config.aliases import apply_aliases
from zerospeed.utils.errors import ConfigError

# (section or "" for the top level, alias, field)
ALIASES: tuple[tuple[str, str, str], ...] = (
    ("", "kernel_inject", "replace_with_kernel_inject"),
    ("", "tp", "tensor_parallel"),
    ("", "tm", "triangular_masking"),
    ("", "ckpt_config", "checkpoint_config"),
    ("", "injection_dict", "injection_policy"),
    ("", "args", "config"),
    ("", "max_tokens", "max_out_tokens"),
    ("", "min_tokens", "min_out_tokens"),
    ("", "expert_group", "ep_group"),
    ("", "expert_mp_group", "ep_mp_group"),
    ("moe", "num_experts", "moe_experts"),
    ("moe", "expert_group", "ep_group"),
)

# deprecated top-level key -> (section, field) it moved to
DEPRECATED: dict[str, tuple[str, str]] = {
    "mp_size": ("tensor_parallel", "tp_size"),
    "mpu": ("tensor_parallel", "mpu"),
    "ep_size": ("moe", "ep_size"),
    "ep_group": ("moe", "ep_group"),
    "ep_mp_group": ("moe", "ep_mp_group"),
    "moe_experts": ("moe", "moe_experts"),
    "moe_type": ("moe", "type"),
}


def _rename(table: dict[str, Any], alias: str, field: str, where: str) -> None:
    if alias not in table:
        return
    if field in table:
        raise ConfigError(
            f"{where}{alias} and {where}{field} are the same setting ({alias} is DeepSpeed's alias "
            f"of {field}); give only {where}{field}"
        )
    table[field] = table.pop(alias)


def _section(raw: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = raw.get(name)
    return value if isinstance(value, dict) else None


def apply_inference_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with aliases and deprecated keys in their DeepSpeed 0.19 places (shallow copies:
    process groups and module classes in the values are kept as they are)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    if isinstance(out.get("moe"), bool):  # DeepSpeed's older `moe=True`
        out["moe"] = {"enabled": out["moe"]}
    for section, alias, field in ALIASES:
        table = out if not section else _section(out, section)
        if table is not None:
            _rename(table, alias, field, f"{section}." if section else "")
    for old, (section, field) in DEPRECATED.items():
        if old not in out:
            continue
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            continue  # the section's own validation reports it
        if field in target:
            raise ConfigError(f"{old} (deprecated) and {section}.{field} were both given; give only {section}.{field}")
        warnings.warn(f"inference config: {old} is deprecated, use {section}.{field}", DeprecationWarning, stacklevel=3)
        target[field] = out.pop(old)
    zero = _section(out, "zero")
    if zero is not None:  # the training config's ZeRO spellings (stage3_ prefixes, cpu_offload, ...)
        out["zero"] = apply_aliases({"zero_optimization": zero})["zero_optimization"]
    return out
