"""`zerospeed.init_inference(model, config=None, **kwargs)`: DeepSpeed's entry point to the inference engine.

`config` is a dict, a path to a JSON file, or a `DeepSpeedInferenceConfig`; keyword arguments are more
config keys. A key given both ways with different values is an error naming both (DeepSpeed's rule);
the comparison is made after each side's aliases are resolved, so `tp={...}` in the config and
`tensor_parallel={...}` as a keyword argument are recognised as the same key.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from zerospeed.config.schema.base import show
from zerospeed.inference.aliases import apply_inference_aliases
from zerospeed.inference.config import _DTYPES, DeepSpeedInferenceConfig, validate_inference_config
from zerospeed.inference.engine import InferenceEngine
from zerospeed.utils.errors import ConfigError


def _as_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, DeepSpeedInferenceConfig):
        return {k: getattr(config, k) for k in config.model_fields_set}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, dict):
        return config
    raise ConfigError(
        f"init_inference: config must be a dict, a path to a JSON file or a DeepSpeedInferenceConfig, "
        f"got {type(config).__name__}"
    )


def _same(a: Any, b: Any) -> bool:
    def norm(v):  # "fp16" and torch.float16 are the same dtype
        key = v.lower() if isinstance(v, str) else v
        return _DTYPES.get(key, v) if isinstance(key, (str, torch.dtype)) else v

    try:
        return bool(norm(a) == norm(b))
    except Exception:  # tensors, groups: only the same object counts as the same value
        return a is b


def merge_config(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config dict with the keyword arguments added; conflicts are errors naming both."""
    base = apply_inference_aliases(_as_dict(config))
    extra = apply_inference_aliases(kwargs)
    for key in sorted(set(base) & set(extra)):
        if not _same(base[key], extra[key]):
            raise ConfigError(
                f"init_inference: {key} is given twice with different values: config[{key!r}] = "
                f"{show(base[key])} and the keyword argument {key}={show(extra[key])}; give it once"
            )
    return {**base, **extra}


def init_inference(model: torch.nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Prepare `model` for inference: `InferenceEngine(model, DeepSpeedInferenceConfig(config + kwargs))`."""
    return InferenceEngine(model, validate_inference_config(merge_config(config, kwargs)))
