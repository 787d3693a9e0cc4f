"""The layout-independent ("universal") form of a checkpoint: full per-parameter tensors.

Rank files hold pieces of parameters in whatever layout the saving run used. `load_universal`
streams the files one at a time (memory-mapped, so only the pieces it copies are read) and lays each
piece into a full tensor per parameter: its fp32 master ("fp32") and each elementwise optimizer state
(e.g. "exp_avg"). Resharding fills a new layout's entries from this form (`zero.shards.fill_entry`);
consolidation returns its "fp32" tensors. Peak memory is the requested full tensors plus the pages of
one file being copied.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.layout import partition_from_manifest

logger = logging.getLogger(__name__)

FP32 = "fp32"  # the key of the master weights in the universal form


def uncovered(intervals: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The sub-ranges of [0, numel) that no half-open interval in `intervals` covers."""
    gaps, reached = [], 0
    for lo, hi in sorted(intervals):
        if lo > reached:
            gaps.append((reached, lo))
        reached = max(reached, hi)
    if reached < numel:
        gaps.append((reached, numel))
    return gaps


@dataclass
class UniversalState:
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> key -> full tensor
    scalars: dict[str, dict] = field(default_factory=dict)  # name -> scalar optimizer state (e.g. step)
    groups: dict[str, int] = field(default_factory=dict)  # name -> optimizer param group index


def files_holding(manifest: dict, names: set[str] | None) -> list[str]:
    """Rank files with at least one piece of the named parameters (all trainable ones when None)."""
    return [rf.file for rf in partition_from_manifest(manifest)
            if any(names is None or p.name in names for e in rf.entries for p in e.pieces)]


def load_universal(tag_dir: Path, manifest: dict, *, names: set[str] | None = None,
                   keys: set[str] | None = None) -> UniversalState:
    """Full tensors of the named trainable parameters (all when None) for `keys` (FP32 and every
    elementwise optimizer state when None), assembled from the rank files of `tag_dir`."""
    specs = manifest["parameters"]
    out = UniversalState()
    spans: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for rf in partition_from_manifest(manifest):
        wanted = [(i, e) for i, e in enumerate(rf.entries)
                  if any(names is None or p.name in names for p in e.pieces)]
        if not wanted:
            continue
        data = torch.load(Path(tag_dir) / rf.file, map_location="cpu", mmap=True, weights_only=True)
        for i, layout in wanted:
            record = data["entries"][i]
            sources = {FP32: record["master"], **{k: record["state"][k] for k in layout.elementwise}}
            for piece in layout.pieces:
                if names is not None and piece.name not in names:
                    continue
                full = out.tensors.setdefault(piece.name, {})
                for key, src in sources.items():
                    if keys is not None and key not in keys:
                        continue
                    if key not in full:
                        full[key] = torch.zeros(prod(specs[piece.name]["shape"]), dtype=src.dtype)
                    full[key][piece.param_offset:piece.param_offset + piece.numel].copy_(
                        src[piece.offset:piece.offset + piece.numel])
                    spans[piece.name, key].append((piece.param_offset, piece.param_offset + piece.numel))
                out.scalars.setdefault(piece.name, {k: _own(record["state"][k]) for k in layout.scalars})
                out.groups.setdefault(piece.name, layout.group)
        del data  # unmaps the file before the next one is opened
    _check_coverage(out, spans, specs, names, keys, tag_dir)
    for name, full in out.tensors.items():
        for key in full:
            full[key] = full[key].view(specs[name]["shape"])
    return out


def _own(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _check_coverage(out: UniversalState, spans, specs, names, keys, tag_dir) -> None:
    expected = [n for n, s in specs.items() if s["trainable"] and (names is None or n in names)]
    for name in expected:
        numel = prod(specs[name]["shape"])
        full = out.tensors.get(name, {})
        if (keys is None or FP32 in keys) and (gaps := uncovered(spans[name, FP32], numel)):
            raise CheckpointError(f"checkpoint {tag_dir}: elements {gaps} of parameter {name!r} are in no rank "
                                  "file — the partition map does not cover it")
        for key in [k for k in full if k != FP32]:
            if gaps := uncovered(spans[name, key], numel):
                logger.warning("checkpoint %s: optimizer state %r of %s misses elements %s; dropping it",
                               tag_dir, key, name, gaps)
                del full[key]
