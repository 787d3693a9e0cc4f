"""safetensors files through the `safetensors` package, with zerospeed's guarantees on top.

Writes are atomic (a temporary file in the same directory, renamed over the final name: no reader
ever sees half a file); a file that cannot be read raises `SafetensorsError` naming it and the fix.
Read tensors are the package's copy-on-write maps of the file: reading costs page cache, not a second
copy in memory, and writing to a tensor never changes the file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from zerospeed.utils.files import atomic_write_named


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or lacks a tensor asked for; the message names the file and the fix."""


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` atomically to `path`, `metadata` (str to str) as the file's `__metadata__`.

    A non-contiguous tensor is packed first (a copy of that tensor alone). Tensors that overlap in
    memory are refused by the package (RuntimeError): store a tied tensor once and clone a partial
    view of another — `export_state_dict` does both. Disjoint views of one buffer are written in place.
    """
    path = Path(path)
    packed = {k: v.detach().contiguous() for k, v in tensors.items()}
    try:
        atomic_write_named(path, lambda tmp: save_file(packed, str(tmp), metadata=metadata or None))
    except KeyError as exc:  # the package looks each tensor's dtype up in its table
        if not (exc.args and isinstance(exc.args[0], torch.dtype)):
            raise
        names = [k for k, v in packed.items() if v.dtype == exc.args[0]]
        raise TypeError(
            f"{path}: safetensors cannot store {names} of dtype {exc.args[0]}; "
            "convert them (e.g. .float()) or save with torch.save"
        ) from None


def read_safetensors(path: Path, names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file: every tensor in name order, or only `names` (the
    others are never read)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            wanted = f.keys() if names is None else list(names)
            if missing := sorted(set(wanted) - set(f.keys())):
                raise SafetensorsError(
                    f"{path} holds no tensor {', '.join(map(repr, missing))} (it holds "
                    f"{len(f.keys())}); check the names, or that this is the right file"
                )
            return {n: f.get_tensor(n) for n in wanted}, f.metadata() or {}
    except SafetensorError as exc:
        raise SafetensorsError(
            f"{path} is not a readable safetensors file ({exc}): it is truncated or corrupt; "
            "write it again, or copy it again from where it came from"
        ) from None
