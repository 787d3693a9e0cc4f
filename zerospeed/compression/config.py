"""``parse_compression_config``: the ``compression_training`` block out of whatever
``init_compression`` was given (a config dict, a parsed config, a JSON path or string), validated by
the schema in ``zerospeed/config/schema/compression.py`` that the root config uses too."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ValidationError

from zerospeed.config.schema.base import show
from zerospeed.config.schema.compression import ROOT_KEY, CompressionConfig
from zerospeed.config.validation import translate
from zerospeed.utils.errors import ConfigError

__all__ = ["CompressionConfig", "ROOT_KEY", "parse_compression_config"]


def _raw_block(deepspeed_config: Any) -> dict:
    """The ``compression_training`` dict out of a path, a JSON string, a full config or the block."""
    if isinstance(deepspeed_config, BaseModel):  # a parsed ZeroSpeedConfig
        block = deepspeed_config.model_dump(exclude_unset=True).get(ROOT_KEY)
        return block or {}
    if isinstance(deepspeed_config, (str, os.PathLike)):
        text = str(deepspeed_config)
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        deepspeed_config = json.loads(text)
    if not isinstance(deepspeed_config, dict):
        raise ConfigError(
            f"{ROOT_KEY}: expected a config dict, a JSON path or a JSON string, got {type(deepspeed_config).__name__}"
        )
    block = deepspeed_config.get(ROOT_KEY, {})
    if not isinstance(block, dict):
        raise ConfigError(f"{ROOT_KEY}: expected an object ({{...}}), got {show(block)}")
    return block


def parse_compression_config(deepspeed_config: Any) -> CompressionConfig:
    """Validate the ``compression_training`` block of a DeepSpeed config (dict, path or JSON string)."""
    try:
        return CompressionConfig.model_validate(_raw_block(deepspeed_config))
    except ValidationError as exc:
        raise translate(exc, prefix=(ROOT_KEY,)) from None
