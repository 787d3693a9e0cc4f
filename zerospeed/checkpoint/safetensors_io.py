"""The safetensors file format, written and read without the `safetensors` package.

Layout (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian u64 N, then
N bytes of UTF-8 JSON {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
optionally "__metadata__": {str: str}}, then the raw little-endian tensor bytes; offsets are relative
to the end of the header and tensors are stored back to back. The header is padded with spaces to
a multiple of 8 bytes so tensor data stays aligned.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import BinaryIO

import torch

from zerospeed.checkpoint.atomic import atomic_write

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_ALIGN = 8


class SafetensorsError(ValueError):
    """A file is not valid safetensors; the message names the file and what is wrong."""


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors I/O here assumes a little-endian machine")


def build_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the padded JSON header for `tensors`, stored in the given order."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"safetensors cannot store tensor {name!r} of dtype {t.dtype}")
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (no two may share memory — store a tied tensor once) atomically to `path`."""
    _check_byteorder()
    ptrs = {}
    for name, t in tensors.items():
        if t.numel() and (key := (t.untyped_storage().data_ptr(), t.storage_offset())) in ptrs:
            raise ValueError(f"safetensors: {name!r} and {ptrs[key]!r} share memory; keep one of them")
        if t.numel():
            ptrs[key] = name
    header = build_header(tensors, metadata)

    def write(f: BinaryIO) -> None:
        f.write(header)
        for t in tensors.values():
            f.write(_raw_bytes(t))  # one tensor at a time: no second copy of the whole dict

    atomic_write(Path(path), write)


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where tensor data starts) of a safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{path}: header is not valid JSON: {exc}") from None
    return header, 8 + n


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; each tensor owns its memory."""
    _check_byteorder()
    header, start = read_header(path)
    metadata = header.pop("__metadata__", {}) or {}
    size = Path(path).stat().st_size
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if info.get("dtype") not in _BY_NAME:
                raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            dtype, shape = _BY_NAME[info["dtype"]], info["shape"]
            lo, hi = info["data_offsets"]
            expect = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
            if hi - lo != expect or start + hi > size:
                raise SafetensorsError(f"{path}: tensor {name!r} offsets [{lo}, {hi}) do not fit its shape {shape} "
                                       f"and dtype {info['dtype']} within the file ({size} bytes)")
            f.seek(start + lo)
            buf = bytearray(f.read(hi - lo))
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            out[name] = t.reshape(shape)
    return out, metadata
