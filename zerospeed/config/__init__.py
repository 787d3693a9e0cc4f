"""Typed DeepSpeed config: load, resolve aliases and "auto", validate, resolve batch sizes.

Use ``parse_config(path_or_dict, world_size=..., known=...)`` to get a ``ZeroSpeedConfig``.
"""

from zerospeed.config.auto import AutoValue, auto_values_from_hidden_size, resolve_auto
from zerospeed.config.batch import resolve_batch_size
from zerospeed.config.features import check_implemented
from zerospeed.config.loader import load_raw
from zerospeed.config.parse import parse_config
from zerospeed.config.schema.root import ZeroSpeedConfig
from zerospeed.utils.errors import ConfigError

__all__ = [
    "AutoValue",
    "ConfigError",
    "ZeroSpeedConfig",
    "auto_values_from_hidden_size",
    "check_implemented",
    "load_raw",
    "parse_config",
    "resolve_auto",
    "resolve_batch_size",
]
