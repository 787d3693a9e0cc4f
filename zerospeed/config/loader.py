"""Turn what the user passed as a config (dict, JSON file path, or base64 JSON) into a plain dict.

Duplicate keys are rejected anywhere in the document, naming the dotted key, because JSON
parsers silently keep the last one and the user then trains with a value they did not mean.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from pathlib import Path
from typing import Any

from zerospeed.utils.errors import ConfigError

_SHOWN_CHARS = 60


class _PairsDict(dict):
    """A dict built from JSON pairs that remembers which keys appeared more than once."""

    duplicates: list[str]


def _collect_pairs(pairs: list[tuple[str, Any]]) -> _PairsDict:
    out = _PairsDict()
    out.duplicates = []
    for key, value in pairs:
        if key in out and key not in out.duplicates:
            out.duplicates.append(key)
        out[key] = value
    return out


def _child_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _find_duplicate(node: Any, path: str = "") -> str | None:
    """Dotted path of the first duplicated key in the parsed tree, or None."""
    if isinstance(node, dict):
        for key in getattr(node, "duplicates", []):
            return _child_path(path, key)
        for key, value in node.items():
            found = _find_duplicate(value, _child_path(path, key))
            if found:
                return found
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found = _find_duplicate(value, f"{path}[{index}]")
            if found:
                return found
    return None


def _to_plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _to_plain(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_to_plain(value) for value in node]
    return node


def _parse_json(text: str, source: str) -> dict[str, Any]:
    """Parse JSON (or hjson) text, rejecting duplicate keys and a non-object top level."""
    try:
        data = json.loads(text, object_pairs_hook=_collect_pairs)
    except json.JSONDecodeError as exc:
        data = _parse_hjson(text, source, f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}")
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply to read") from None
    duplicate = _find_duplicate(data)
    if duplicate:
        raise ConfigError(f"{source}: duplicate key {duplicate}; a JSON key may appear only once per object")
    return _require_object(_to_plain(data), source)


def _parse_hjson(text: str, source: str, json_error: str) -> Any:
    """Note [hjson configs]: DeepSpeed reads every config with hjson (a superset of JSON: comments,
    unquoted keys and strings, optional commas), so a DeepSpeed user's `ds_config.hjson` must load here
    too. Strict JSON is tried first (its errors name line and column exactly); text that is not JSON is
    read as hjson, with the same duplicate-key check. hjson is a dependency, but it is imported only
    here, so an environment without it still reads JSON and says what to install for the rest."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(
            f"{source}: {json_error} (an hjson config needs the `hjson` package: pip install hjson)"
        ) from None
    try:
        return hjson.loads(text, object_pairs_hook=_collect_pairs)
    except hjson.HjsonDecodeError:  # neither: JSON's message, the more precise of the two
        raise ConfigError(f"{source}: {json_error}") from None
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply to read") from None


def _require_object(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a JSON object at the top level, got {type(data).__name__}")
    return data


def _shorten(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    return _parse_json(text, str(path))


def _decode_base64(text: str) -> str | None:
    """The UTF-8 text a base64 (standard or URL-safe) string encodes, or None if it is not base64."""
    compact = "".join(text.split())
    if not compact:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    for decode in (lambda s: base64.b64decode(s, validate=True), base64.urlsafe_b64decode):
        try:
            return decode(padded).decode("utf-8")
        except (binascii.Error, ValueError, UnicodeDecodeError):
            continue
    return None


def _looks_like_json(text: str) -> bool:
    # Random strings often decode as base64 to junk; only treat the result as JSON if it
    # starts like a JSON document (arrays too, so they get the "not an object" error).
    return text.lstrip()[:1] in ("{", "[")


def _load_string(text: str) -> dict[str, Any]:
    if _is_existing_file(text):
        return _read_file(Path(text))
    decoded = _decode_base64(text)
    if decoded is None or not _looks_like_json(decoded):
        raise ConfigError(
            f"config {_shorten(text)!r} is neither a file that exists nor base64-encoded JSON; "
            "pass a path to a .json file, a dict, or base64 of a JSON object"
        )
    return _parse_json(decoded, "base64 config")


def _is_existing_file(text: str) -> bool:
    try:
        return os.path.isfile(text)
    except (ValueError, OSError):  # e.g. embedded NUL bytes or names too long for the OS
        return False


def _check_tree(node: Any, path: str, ancestors: set[int]) -> None:
    """Reject a dict that contains itself; every later stage walks the config recursively."""
    if not isinstance(node, (dict, list)):
        return
    if id(node) in ancestors:
        raise ConfigError(f"config dict refers to itself at {path}; a config must be a tree")
    ancestors.add(id(node))
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        child = f"{path}[{key}]" if isinstance(node, list) else _child_path(path, key)
        _check_tree(value, child, ancestors)
    ancestors.discard(id(node))


def _copy_dict(config: dict) -> dict[str, Any]:
    try:
        _check_tree(config, "", set())
        return copy.deepcopy(config)
    except RecursionError:
        raise ConfigError("config dict is nested too deeply to read") from None
    except ConfigError:
        raise
    except Exception as exc:  # deepcopy can fail on arbitrary user objects in any way
        raise ConfigError(f"config dict could not be copied: {type(exc).__name__}: {exc}") from None


def load_raw(config: Any) -> dict[str, Any]:
    """Return the config as a fresh plain dict.

    ``config`` may be a dict (deep-copied, so the caller's object is never modified), a path
    (``str`` or ``os.PathLike``) of an existing JSON file, or a base64-encoded JSON object. Raises
    ``ConfigError`` for a missing file, invalid JSON (with line and column), duplicate keys
    (naming the dotted key and the file) and a top level that is not an object.
    """
    if isinstance(config, dict):
        return _copy_dict(config)
    if isinstance(config, os.PathLike):
        path = Path(os.fsdecode(config))
        if not _is_existing_file(str(path)):
            raise ConfigError(f"config file {path} does not exist")
        return _read_file(path)
    if isinstance(config, str):
        return _load_string(config)
    raise ConfigError(
        f"config must be a dict, a path to a .json file, or base64-encoded JSON; got {type(config).__name__}"
    )
