"""The manifest: what a checkpoint holds and how it was laid out, written last as its commit record.

It records the library version, world size, ZeRO stage, parallel layout, every parameter's shape
and dtype, tied names, the partition map (which rank file holds which pieces of which parameter)
and each file's size and sha256. Loading checks files against it, so a missing, truncated or
corrupted file is named instead of surfacing as an unpickling error, and compares the parameters
with the model, so a checkpoint of another model names the parameters that differ.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zerospeed.checkpoint.atomic import sha256_file
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.naming import MANIFEST
from zerospeed.checkpoint.tensor_parallel import Layouts, layouts_from_json
from zerospeed.utils.files import atomic_write_text
from zerospeed.zero.tags import full_shape

FORMAT = "zerospeed-checkpoint"
FORMAT_VERSION = 2
# Version 2 adds tensor-parallel pieces (parallel_layout.shard_specs, rank files' tp_rank), which a
# version-1 reader would take for whole parameters; a checkpoint without them is still written as 1.
PLAIN_FORMAT_VERSION = 1
_SHOW = 8  # names listed in an error before "... and N more"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_specs(module: torch.nn.Module) -> dict[str, dict]:
    """name -> {shape, dtype, trainable} for each distinct parameter (a tied one under its first name)."""
    return {
        n: {"shape": list(full_shape(p)), "dtype": dtype_name(p.dtype), "trainable": p.requires_grad}
        for n, p in module.named_parameters()
    }


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """alias -> first name, for every parameter reachable under more than one name."""
    first: dict[int, str] = {}
    aliases = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[n] = first[id(p)]
        else:
            first[id(p)] = n
    return aliases


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def model_mismatches(saved: dict[str, dict], current: dict[str, dict], *, strict: bool) -> list[str]:
    """Why parameters `saved` (a manifest's) cannot load into a model with `current` (param_specs).

    Shapes must always agree; names missing on either side only count when `strict`.
    """
    problems = []
    if strict:
        missing = [n for n in current if n not in saved]
        extra = [n for n in saved if n not in current]
        if missing:
            problems.append(f"missing from the checkpoint: {_listing(missing)}")
        if extra:
            problems.append(f"in the checkpoint but not in the model: {_listing(extra)}")
    shapes = [
        f"{n} (checkpoint {saved[n]['shape']}, model {current[n]['shape']})"
        for n in current
        if n in saved and list(saved[n]["shape"]) != list(current[n]["shape"])
    ]
    if shapes:
        problems.append(f"shape mismatch: {_listing(shapes)}")
    return problems


def check_model_compat(
    manifest: dict, module: torch.nn.Module, *, strict: bool, where: Path, specs: dict[str, dict] | None = None
) -> None:
    """`specs`: the model's as the checkpoint names them (param_specs(module) when None; with MoE layers,
    every rank's experts under global names — checkpoint/experts.py)."""
    current = param_specs(module) if specs is None else specs
    problems = model_mismatches(manifest["parameters"], current, strict=strict)
    if problems:
        raise CheckpointError(f"checkpoint {where} was saved from a different model: " + "; ".join(problems))


def file_record(path: Path) -> dict:
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def verify_file(tag_dir: Path, name: str, record: dict) -> str | None:
    """None when `tag_dir/name` matches its manifest record, else a message naming the file."""
    path = Path(tag_dir) / name
    if not path.is_file():
        return f"checkpoint file {path} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        kind = "truncated" if size < record["bytes"] else "longer than written"
        return f"checkpoint file {path} is {kind}: {size} bytes, the manifest records {record['bytes']}"
    digest = sha256_file(path)
    if digest != record["sha256"]:
        return f"checkpoint file {path} is corrupted: sha256 {digest} differs from the manifest's {record['sha256']}"
    return None


def verify_files(tag_dir: Path, manifest: dict, names, workers: int = 1) -> str | None:
    """The first problem among the named files, or None. `workers` > 1 (`async_load`) reads and hashes the
    files on that many threads at once (hashlib and file reads release the GIL); reading them whole also
    leaves them in the page cache for the loads that follow."""
    names = list(names)
    for name in names:
        if name not in manifest["files"]:
            return f"checkpoint file {Path(tag_dir) / name} is not listed in the manifest"
    if workers > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(names)), thread_name_prefix="zerospeed-verify") as pool:
            problems = list(pool.map(lambda n: verify_file(tag_dir, n, manifest["files"][n]), names))
    else:
        problems = (verify_file(tag_dir, n, manifest["files"][n]) for n in names)
    return next((p for p in problems if p is not None), None)


def write_manifest(tag_dir: Path, manifest: dict) -> None:
    atomic_write_text(Path(tag_dir) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(tag_dir: Path) -> dict:
    """The manifest of a tag directory; CheckpointError naming the path when absent or unreadable."""
    path = Path(tag_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: {tag_dir} is not a complete zerospeed checkpoint (a save that "
            "did not finish, or a checkpoint written by another library)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zerospeed checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest['format_version']}; this zerospeed reads "
            f"up to {FORMAT_VERSION} — upgrade zerospeed"
        )
    return _upgraded(manifest)


def saved_layouts(manifest: dict) -> Layouts:
    """The checkpoint's tensor-parallel layouts ({} when it was saved without tensor parallelism)."""
    return layouts_from_json(manifest.get("parallel_layout", {}).get("shard_specs"))


def saved_tp(manifest: dict) -> int:
    return int(manifest.get("parallel_layout", {}).get("tensor_parallel", 1))


def _upgraded(manifest: dict) -> dict:
    """A manifest from before `weights_in_shards` was recorded, with it (then only stage-3 checkpoints
    kept their trainable weights in the shards alone). The field is an addition, not a new format:
    older readers ignore it, and read these checkpoints as before."""
    if "weights_in_shards" not in manifest:
        manifest = {**manifest, "weights_in_shards": manifest["zero_stage"] == 3}
    return manifest
