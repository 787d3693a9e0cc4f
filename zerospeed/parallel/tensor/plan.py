"""AutoTP partition rules: which parameter is split column-wise, row-wise, or kept whole.

A rule is a regex over *parameter* names (DeepSpeed's `layer_specs[].patterns`, e.g.
`.*\\.o_proj\\.weight$`), matched with `re.match`, first rule wins. Rules come from, in priority order
(DeepSpeed's: partition_config > the model's tp_plan > built-in presets):

1. `tensor_parallel.partition_config.layer_specs` (`partition_type` column | row | skip, optional fused
   `shape` such as [3, -1] and `partition_dim`, optional `model_types` filter). With
   `use_default_specs` (the default) they are tried first and the rules below still apply after them;
   with `use_default_specs: false` they are the only rules.
2. The model's own transformers plan: `model._tp_plan` entries and `config.base_model_tp_plan`
   (keys like `layers.*.self_attn.q_proj`, values colwise / rowwise / colwise_gather_output /
   packed_colwise), turned into rules on `<key>.weight`.
3. A preset by `config.model_type` (gpt2, llama, mistral, qwen2); `preset_model`, when given, is used
   instead of 2 and 3.

Pure: strings and dicts in, rules out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """Split the weight matched by `pattern` as `kind` (column | row | skip)."""

    pattern: str
    kind: str
    shape: tuple | None = None
    """Fused sub-weights along the split dimension: (k, -1) k equal parts, ((a, b, c), -1) sizes."""
    source: str = ""
    """Where the rule came from, for error messages."""

    def matches(self, name: str) -> bool:
        return re.match(self.pattern, name) is not None


_KINDS = ("column", "row", "skip")

# transformers tp_plan styles we implement, as (kind, fused shape).
_HF_STYLES = {
    "colwise": ("column", None),
    "rowwise": ("row", None),
    "colwise_gather_output": ("column", None),
    "packed_colwise": ("column", (2, -1)),
    "replicate": ("skip", None),
}

_ANY = r"(?:.*\.)?"  # any module prefix (transformer., model., ...)


def _rules(source: str, entries: list[tuple[str, str, tuple | None]]) -> tuple[Rule, ...]:
    return tuple(Rule(_ANY + pattern + r"\.weight$", kind, shape, source) for pattern, kind, shape in entries)


_LLAMA = [
    (r"self_attn\.[qkv]_proj", "column", None),
    (r"self_attn\.o_proj", "row", None),
    (r"mlp\.(?:gate|up)_proj", "column", None),
    (r"mlp\.down_proj", "row", None),
]

PRESETS: dict[str, tuple[Rule, ...]] = {
    # GPT-2's c_attn is the fused [q | k | v] Conv1D: each rank takes its heads of each of the three.
    "gpt2": _rules(
        "preset gpt2",
        [
            (r"attn\.c_attn", "column", (3, -1)),
            (r"attn\.c_proj", "row", None),
            (r"mlp\.c_fc", "column", None),
            (r"mlp\.c_proj", "row", None),
        ],
    ),
    "llama": _rules("preset llama", _LLAMA),
    "mistral": _rules("preset mistral", _LLAMA),
    "qwen2": _rules("preset qwen2", _LLAMA),
}


def hf_plan_rules(plan: dict[str, str] | None, source: str = "tp_plan") -> tuple[Rule, ...]:
    """Rules from a transformers tp plan ({"layers.*.self_attn.q_proj": "colwise", ...})."""
    rules = []
    for key, style in (plan or {}).items():
        if style not in _HF_STYLES:
            raise ValueError(
                f"{source} entry {key!r}: {style!r} is not a partition style zerospeed implements "
                f"(known: {sorted(_HF_STYLES)}); give this layer a tensor_parallel.partition_config."
                f"layer_specs rule instead, with partition_type column, row or skip"
            )
        kind, shape = _HF_STYLES[style]
        pattern = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split("."))
        rules.append(Rule(_ANY + pattern + r"\.weight$", kind, shape, f"{source} {key!r}: {style!r}"))
    return tuple(rules)


def _as_dict(obj: Any) -> dict:
    if obj is None:
        return {}
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return dict(obj)


def layer_spec_rules(partition_config: Any, model_type: str | None) -> tuple[Rule, ...]:
    """Rules from DeepSpeed's `partition_config.layer_specs` (dicts or the parsed config)."""
    rules = []
    for i, spec in enumerate(_as_dict(partition_config).get("layer_specs") or []):
        spec = _as_dict(spec)
        types = spec.get("model_types")
        if types and model_type not in types:
            continue
        kind = spec.get("partition_type", "column")
        if kind not in _KINDS:
            raise ValueError(f"partition_config.layer_specs[{i}].partition_type = {kind!r}; expected one of {_KINDS}")
        dim = spec.get("partition_dim")
        if spec.get("shape") and dim not in (None, 0):
            raise ValueError(
                f"partition_config.layer_specs[{i}]: partition_dim={dim} is not supported; fused "
                "weights split along the output features (partition_dim 0 of an nn.Linear weight)"
            )
        shape = tuple(tuple(s) if isinstance(s, list) else s for s in spec["shape"]) if spec.get("shape") else None
        for pattern in spec.get("patterns") or []:
            rules.append(Rule(pattern, kind, shape, f"partition_config.layer_specs[{i}]"))
    return tuple(rules)


def resolve_rules(
    *,
    partition_config: Any = None,
    tp_plans: list[dict[str, str]] | None = None,
    model_type: str | None = None,
    preset_model: str | None = None,
) -> tuple[Rule, ...]:
    """The ordered rules for a model; see the module docstring for the priority."""
    custom = layer_spec_rules(partition_config, model_type)
    use_defaults = _as_dict(partition_config).get("use_default_specs", True)
    if custom and not use_defaults:
        return custom
    hf = tuple(r for plan in (tp_plans or []) for r in hf_plan_rules(plan))
    if preset_model is not None and preset_model not in PRESETS:
        raise ValueError(f"tensor_parallel.preset_model = {preset_model!r} is not known; presets: {sorted(PRESETS)}")
    if preset_model is not None:  # named explicitly: it wins over the model's own plan
        return custom + PRESETS[preset_model]
    return custom + (hf or PRESETS.get(model_type or "", ()))


def first_match(name: str, rules: tuple[Rule, ...]) -> Rule | None:
    return next((r for r in rules if r.matches(name)), None)
