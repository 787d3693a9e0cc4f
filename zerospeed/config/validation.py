"""Validate a raw config dict into ``ZeroSpeedConfig``, turning pydantic errors into ``ConfigError``.

Every message names the full dotted key. Unknown keys get the closest valid key at that level
("zero_optimization.overlap_com: unknown key — did you mean overlap_comm?"); wrong types and
ranges say what is accepted. Several problems are listed one per line.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from zerospeed.config.schema.base import ERROR_KIND, show
from zerospeed.config.schema.root import ZeroSpeedConfig
from zerospeed.utils.errors import ConfigError

_MAX_LISTED_KEYS = 15


def dotted(loc: tuple[Any, ...]) -> str:
    """Render a pydantic location as ``a.b[0].c``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "<top level>"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation such as ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None


def model_at(loc: tuple[Any, ...], root: type[BaseModel] = ZeroSpeedConfig) -> type[BaseModel] | None:
    """The model class that validates the object at ``loc`` (list indices are skipped)."""
    model: type[BaseModel] | None = root
    key_next = False  # the part after a ``dict[str, X]`` field is a user-chosen key: skip it
    for part in loc:
        if isinstance(part, int) or key_next:
            key_next = False
            continue
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        key_next = _is_mapping(annotation)
        model = _model_in(annotation)
    return model


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_mapping(arg) for arg in typing.get_args(annotation))
    return origin is dict


def _unknown_key(loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    model = model_at(loc[:-1])
    valid = sorted(model.model_fields) if model else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key — did you mean {close[0]}?"
    if valid and len(valid) <= _MAX_LISTED_KEYS:
        return f"unknown key; valid keys here: {', '.join(valid)}"
    return "unknown key (not a DeepSpeed config key at this level)"


def _describe(error: dict[str, Any]) -> str:
    kind, value = error["type"], error.get("input")
    if kind == ERROR_KIND:
        return error["msg"]
    if kind == "extra_forbidden":
        return _unknown_key(error["loc"])
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected an object ({{...}}), got {show(value)}"
    if kind == "list_type":
        return f"expected a list, got {show(value)}"
    if kind == "missing":
        return "required key is missing"
    if kind == "invalid_key":
        return f"keys must be strings, got {show(value)}"
    return f"{error['msg'].rstrip('.')}, got {show(value)}"


def _line(error: dict[str, Any]) -> str:
    loc = error["loc"]
    if error["type"] == "invalid_key":
        return f"{dotted(loc[:-1])}: {_describe(error)}"
    return f"{dotted(loc)}: {_describe(error)}"


def translate(exc: ValidationError, prefix: tuple[str, ...] = ()) -> ConfigError:
    """A ``ConfigError`` listing every problem of ``exc``, one per line; ``prefix`` is where the
    validated object sits in the whole config (for a section validated alone)."""
    lines = [_line({**error, "loc": (*prefix, *error["loc"])}) for error in exc.errors(include_url=False)]
    if len(lines) == 1:
        return ConfigError(lines[0])
    return ConfigError(f"{len(lines)} problems in the config:\n" + "\n".join(lines))


def validate_config(raw: dict[str, Any]) -> ZeroSpeedConfig:
    """Validate a raw (alias- and auto-resolved) dict into ``ZeroSpeedConfig``."""
    try:
        return ZeroSpeedConfig.model_validate(raw)
    except ValidationError as exc:
        raise translate(exc) from None
