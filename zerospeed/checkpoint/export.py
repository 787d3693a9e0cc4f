"""Writing a consolidated state dict the way Hugging Face `save_pretrained` lays it out.

One file (`pytorch_model.bin`, or `model.safetensors` with safe serialization) when it fits in
`max_shard_size`, else numbered shards (`pytorch_model-00001-of-00003.bin`) plus an index
(`pytorch_model.bin.index.json`: {"metadata": {"total_size": bytes}, "weight_map": {name: file}}) —
DeepSpeed's `zero_to_fp32` names, defaults and shard grouping.
Tied tensors: a safetensors file cannot hold two names for one memory, so an alias is stored once,
under its first name, and listed in the file metadata and the index ("tied": {alias: name});
torch.save keeps the sharing by itself, so a .bin shard holds both names. See Note [safetensors and
shared memory] for views that overlap without being aliases.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from zerospeed.checkpoint.atomic import atomic_torch_save
from zerospeed.checkpoint.safetensors_io import read_safetensors, write_safetensors
from zerospeed.utils.files import atomic_write_text

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB" (10^9 units) or "500MiB" (2^20 units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int | None) -> list[list[str]]:
    """Names grouped into shards of at most `max_bytes` (None: one shard), as DeepSpeed's converter groups
    them (Hugging Face's `split_torch_state_dict_into_shards`): consecutive names fill the open shard,
    which is closed when the next name does not fit; a tensor larger than `max_bytes` gets a shard of
    its own at once while the open shard stays open for the names after it."""
    if max_bytes is None:
        return [[name for name, _ in sizes]] if sizes else []
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, n in sizes:
        if n > max_bytes:
            shards.append([name])
            continue
        if filled + n > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += n
    if current:
        shards.append(current)
    return shards


def shard_name(stem: str, ext: str, index: int, count: int) -> str:
    return f"{stem}-{index + 1:05d}-of-{count:05d}.{ext}"


def split_aliases(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors under their first name, {alias: first name}) — an alias views the same memory."""
    first: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for k, v in state_dict.items():
        key = (
            (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else ("empty", k)
        )
        if key in first:
            aliases[k] = first[key]
        else:
            first[key] = k
            unique[k] = v
    return unique, aliases


def clone_overlapping(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with no two overlapping in memory: of overlapping ones the longest is kept, the others cloned.

    Note [safetensors and shared memory]: the `safetensors` package refuses tensors that overlap in
    memory. Exact aliases are split off before (stored once, listed as tied); what still overlaps is
    a partial view of another tensor, or the same bytes under another shape or dtype, and is stored
    as its own copy. Disjoint views of one buffer (the consolidated fp32 masters) are not copied, so an
    export adds no second copy of the model; non-contiguous tensors are packed by `write_safetensors`.
    """
    out = dict(tensors)
    # by start, the longest first: a tensor and a part of it keep the whole and clone the part
    spans = sorted((str(v.device), v.data_ptr(), -v.nbytes, k) for k, v in tensors.items() if v.is_contiguous())
    reach: dict[str, int] = {}  # per device: the end of the kept tensors so far (pairwise disjoint)
    for device, start, neg_nbytes, name in spans:
        if start < reach.get(device, start):
            out[name] = tensors[name].clone()
        else:
            reach[device] = start - neg_nbytes
    return out


def export_state_dict(
    state_dict: dict[str, torch.Tensor],
    output_dir,
    *,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
) -> list[Path]:
    """Write `state_dict` into `output_dir` (torch.save by default, safetensors with `safe_serialization`,
    DeepSpeed's defaults); `max_shard_size=None` never shards. Returns the paths written (the index
    last, when sharded)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    unique, aliases = split_aliases(state_dict)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    shards = plan_shards([(k, v.nbytes) for k, v in unique.items()], limit)
    count = len(shards)
    files = [f"{stem}.{ext}"] if count <= 1 else [shard_name(stem, ext, i, count) for i in range(count)]
    owner = {k: files[i] for i, names in enumerate(shards) for k in names}
    written = []
    for i, names in enumerate(shards or [[]]):
        members = set(names)
        tied_here = {a: c for a, c in aliases.items() if c in members}
        path = out / files[i]
        if safe_serialization:
            write_safetensors(
                path,
                clone_overlapping({k: unique[k] for k in names}),
                {"format": "pt", **({"tied": json.dumps(tied_here)} if tied_here else {})},
            )
        else:
            atomic_torch_save({k: v for k, v in state_dict.items() if k in members or k in tied_here}, path)
        written.append(path)
    index = out / f"{stem}.{ext}.index.json"
    if len(shards) > 1:
        weight_map = dict(owner)
        if not safe_serialization:
            weight_map.update({a: owner[c] for a, c in aliases.items()})
        body = {
            "metadata": {"total_size": sum(v.nbytes for v in unique.values()), "tied": aliases},
            "weight_map": weight_map,
        }
        atomic_write_text(index, json.dumps(body, indent=1) + "\n")
        written.append(index)
        (out / f"{stem}.{ext}").unlink(missing_ok=True)  # a stale single file would shadow the shards
    else:
        index.unlink(missing_ok=True)
    return written


def read_exported(output_dir) -> dict[str, torch.Tensor]:
    """Read back what `export_state_dict` wrote (either format, one file or shards); tied names share one tensor."""
    out = Path(output_dir)
    for stem, ext in (("model", "safetensors"), ("pytorch_model", "bin")):
        single, index = out / f"{stem}.{ext}", out / f"{stem}.{ext}.index.json"
        if index.is_file():
            body = json.loads(index.read_text())
            files = list(dict.fromkeys(body["weight_map"].values()))
            return _read_files([out / f for f in files], ext, body.get("metadata", {}).get("tied", {}))
        if single.is_file():
            return _read_files([single], ext, {})
    raise FileNotFoundError(f"{out} holds no model.safetensors, pytorch_model.bin or their index")


def _read_files(paths: list[Path], ext: str, tied: dict[str, str]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for path in paths:
        if ext == "bin":
            sd.update(torch.load(path, map_location="cpu", weights_only=True))
            continue
        tensors, metadata = read_safetensors(path)
        sd.update(tensors)
        tied = {**tied, **json.loads(metadata.get("tied", "{}"))}
    for alias, name in tied.items():
        sd[alias] = sd[name]
    return sd
