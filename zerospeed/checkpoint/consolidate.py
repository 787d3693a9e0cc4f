"""Consolidation without processes or GPUs: one fp32 state dict from any zerospeed checkpoint.

The trainable parameters come from the fp32 masters in the rank files (universal.py streams them
one file at a time, memory-mapped), frozen parameters and buffers from the model states file(s); keys
follow the model's `state_dict()` order and tied names share one tensor, so the result loads with
`strict=True` into the plain model. A tensor-parallel checkpoint gives the same: every tensor full, in
the layout of the model before sharding (Note [canonical tensors] in tensor_parallel.py), which a
transformers model reads with `from_pretrained` once exported (`convert_zero_checkpoint_to_fp32_state_dict`
plus the model's config.json). Peak memory is about one fp32 copy of the trainable parameters
plus the pages of the file being read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.export import export_state_dict
from zerospeed.checkpoint.manifest import read_manifest, verify_files
from zerospeed.checkpoint.module_state import SavedModule
from zerospeed.checkpoint.naming import MANIFEST, MODEL_STATES, CheckpointPaths, check_tag
from zerospeed.checkpoint.tags import read_latest, resolve_tag_dir
from zerospeed.checkpoint.universal import FP32, load_universal

logger = logging.getLogger(__name__)


def resolve_checkpoint(checkpoint_dir, tag: str | None = None) -> tuple[Path, dict]:
    """(tag directory, manifest) for `tag`, or for the tag `latest` names (or `checkpoint_dir` itself when
    it is a tag directory); errors name what is missing."""
    root = Path(checkpoint_dir)
    if tag is None and (root / MANIFEST).is_file():
        return root, read_manifest(root)
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(f"{root / 'latest'} does not exist: pass tag= (one of the sub-directories of {root})")
    tag_dir = resolve_tag_dir(CheckpointPaths(root, check_tag(str(tag))))
    return tag_dir, read_manifest(tag_dir)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full state dict with fp32 master weights, from a checkpoint of any world size and stage.

    Trainable parameters are the fp32 masters; frozen parameters (unless excluded) and buffers are as
    saved. Tied names share one tensor. Every file read is verified against the manifest first.
    DeepSpeed's signature: with `lazy_mode` DeepSpeed returns placeholders that `.contiguous()`
    materialises; the tensors here are already CPU tensors read from memory-mapped files (and
    `.contiguous()` on them is a no-op), so code written for either mode works unchanged.
    """
    tag_dir, manifest = resolve_checkpoint(checkpoint_dir, tag)
    if (problem := verify_files(tag_dir, manifest, list(manifest["files"]))) is not None:
        raise CheckpointError(problem)
    masters = {n: t[FP32] for n, t in load_universal(tag_dir, manifest, keys={FP32}).tensors.items()}
    saved = SavedModule(
        tag_dir, manifest, torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
    )
    params, tied = manifest["parameters"], manifest["tied"]
    out: dict[str, torch.Tensor] = {}
    for key in manifest["module_keys"]:
        name = tied.get(key, key)
        if name in masters:
            out[key] = masters[name]
        elif name in params and exclude_frozen_parameters:
            continue
        elif key in saved:
            # a frozen alias shares its tensor with the first name, as in the model
            out[key] = out[name] if name in out and name != key else saved.full(key).clone()
        elif key not in manifest.get("excluded_frozen", ()):
            raise CheckpointError(f"checkpoint {tag_dir}: {key!r} is in neither the rank files nor {MODEL_STATES}")
    del saved
    if manifest.get("excluded_frozen") and not exclude_frozen_parameters:
        logger.warning(
            "checkpoint %s was saved without its frozen parameters (%s); they are absent here",
            tag_dir,
            ", ".join(manifest["excluded_frozen"][:8]),
        )
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the fp32 state dict as pytorch_model.bin (torch.save), or model.safetensors with
    `safe_serialization`, sharded with an index json when larger than `max_shard_size`.

    DeepSpeed's signature, positional order and defaults (`deepspeed.utils.zero_to_fp32`) and its
    file names (`pytorch_model-00001-of-00002.bin` + `pytorch_model.bin.index.json`, or the same
    with `model` / `.safetensors`). Returns the files written (DeepSpeed returns None).
    """
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    return export_state_dict(sd, output_dir, max_shard_size=max_shard_size, safe_serialization=safe_serialization)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir, tag: str | None = None, *, strict: bool = False
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model`, moved to the CPU (values are copied into the
    dtypes of its tensors); returns the model.

    As DeepSpeed, the load is not strict by default; keys that do not match are logged as a warning
    (DeepSpeed says nothing). `strict=True` (ours, keyword-only) makes them an error.
    """
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(sd, strict=strict)
    if result.missing_keys or result.unexpected_keys:
        logger.warning(
            "load_state_dict_from_zero_checkpoint: the checkpoint does not match the model: "
            "missing %s, unexpected %s (pass strict=True to make this an error)",
            result.missing_keys[:8],
            result.unexpected_keys[:8],
        )
    return model
