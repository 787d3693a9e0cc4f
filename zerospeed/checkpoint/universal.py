"""The layout-independent ("universal") form of a checkpoint: full per-parameter tensors.

Rank files hold pieces of parameters in whatever layout the saving run used. `load_universal`
streams the files one at a time (memory-mapped, so only the pieces it copies are read) and lays each
piece into a full tensor per parameter: its fp32 master ("fp32") and each elementwise optimizer state
(e.g. "exp_avg"). Resharding fills a new layout's entries from this form (`fill_from_universal`, for a
resharded zerospeed checkpoint and for DeepSpeed's alike); consolidation returns its "fp32" tensors.
Peak memory is the requested full tensors plus the pages of one file being copied (and, for a
tensor-parallel checkpoint, the tp ranks' local pieces of them until each full tensor is assembled:
Note [canonical tensors] in tensor_parallel.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_pickle import readable_deepspeed_objects
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.layout import entry_groups, partition_from_manifest
from zerospeed.checkpoint.manifest import saved_layouts
from zerospeed.checkpoint.naming import is_model_states_name
from zerospeed.checkpoint.tensor_parallel import assemble_full, local_shape, writer_ranks
from zerospeed.zero.shards import ShardEntry, fill_entry

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
    return [
        rf.file
        for rf in partition_from_manifest(manifest)
        if any(names is None or p.name in names for e in rf.entries for p in e.pieces)
    ]


def load_entries_file(tag_dir: Path, file: str) -> dict:
    """The rank file `file` of the tag (memory-mapped), whose `entries` hold masters and optimizer states. A tag
    saved with checkpoint.deepspeed_layout also holds DeepSpeed's objects (`readable_deepspeed_objects`), and at
    ZeRO 0 its entries are in the model states (Note [as-saved ZeRO 0]), which load as any model states do."""
    with readable_deepspeed_objects():
        return torch.load(tag_dir / file, map_location="cpu", mmap=True, weights_only=not is_model_states_name(file))


def load_universal(
    tag_dir: Path, manifest: dict, *, names: set[str] | None = None, keys: set[str] | None = None
) -> UniversalState:
    """Full (canonical) tensors of the named trainable parameters (all when None) for `keys` (FP32 and
    every elementwise optimizer state when None), assembled from the rank files of `tag_dir`: each tp
    rank's local tensor from its data-parallel pieces, then the full tensor from the tp ranks' pieces."""
    specs = manifest["parameters"]
    layouts = saved_layouts(manifest)
    out = UniversalState()
    local: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (name, tp rank) -> key -> flat local tensor
    spans: dict[tuple[str, int, str], list[tuple[int, int]]] = defaultdict(list)
    for rf in partition_from_manifest(manifest):
        wanted = [(i, e) for i, e in enumerate(rf.entries) if any(names is None or p.name in names for p in e.pieces)]
        if not wanted:
            continue
        data = load_entries_file(Path(tag_dir), rf.file)
        for i, layout in wanted:
            record = data["entries"][i]
            sources = {FP32: record["master"], **{k: record["state"][k] for k in layout.elementwise}}
            sources = {k: v.reshape(-1) for k, v in sources.items()}  # (entries in the parameter's shape)
            for piece in layout.pieces:
                if names is not None and piece.name not in names:
                    continue
                flat = local.setdefault((piece.name, rf.tp_rank), {})
                for key, src in sources.items():
                    if keys is not None and key not in keys:
                        continue
                    if key not in flat:
                        shape = local_shape(specs[piece.name]["shape"], layouts.get(piece.name), rf.tp_rank)
                        flat[key] = torch.zeros(prod(shape), dtype=src.dtype)
                    flat[key][piece.param_offset : piece.param_offset + piece.numel].copy_(
                        src[piece.offset : piece.offset + piece.numel]
                    )
                    spans[piece.name, rf.tp_rank, key].append((piece.param_offset, piece.param_offset + piece.numel))
                out.scalars.setdefault(piece.name, {k: _own(record["state"][k]) for k in layout.scalars})
                out.groups.setdefault(piece.name, layout.group)
        del data  # unmaps the file before the next one is opened
    _check_coverage(local, spans, specs, layouts, names, keys, tag_dir)
    for name in dict.fromkeys(n for n, _ in local):
        out.tensors[name] = _assembled(local, name, specs[name]["shape"], layouts.get(name))
    return out


def _assembled(local: dict, name: str, shape: list[int], layout) -> dict[str, torch.Tensor]:
    """key -> the full tensor of `name`, from (and freeing) the writer tp ranks' flat local tensors; a key
    some writer lacks (an optimizer state dropped for gaps) is left out."""
    ranks = writer_ranks(layout)
    per_rank = [local.pop((name, r), {}) for r in ranks]
    common = set.intersection(*(set(d) for d in per_rank))
    return {
        key: assemble_full(
            {r: d[key].view(local_shape(shape, layout, r)) for r, d in zip(ranks, per_rank)}, layout
        ).view(shape)
        for key in sorted(common)
    }


def _own(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _check_coverage(local, spans, specs, layouts, names, keys, tag_dir) -> None:
    """Every element of every expected parameter's master is in some rank file (else CheckpointError);
    an optimizer state with gaps is dropped (with a warning), the parameter's other states kept."""
    expected = [n for n, s in specs.items() if s["trainable"] and (names is None or n in names)]
    for name in expected:
        layout = layouts.get(name)
        for r in writer_ranks(layout):
            numel = prod(local_shape(specs[name]["shape"], layout, r))
            flat = local.get((name, r), {})
            where = f"tp rank {r}'s piece of parameter {name!r}" if layout is not None else f"parameter {name!r}"
            if (keys is None or FP32 in keys) and (gaps := uncovered(spans[name, r, FP32], numel)):
                raise CheckpointError(
                    f"checkpoint {tag_dir}: elements {gaps} of {where} are in no rank file (its "
                    f"pieces belong in zero_pp_rank_*_mp_rank_{r:02d}_optim_states.pt) — the "
                    "partition map does not cover it; the checkpoint is incomplete, save it again"
                )
            for key in [k for k in flat if k != FP32]:
                if gaps := uncovered(spans[name, r, key], numel):
                    logger.warning(
                        "checkpoint %s: optimizer state %r of %s misses elements %s; dropping it",
                        tag_dir,
                        key,
                        where,
                        gaps,
                    )
                    del flat[key]


def scalar_state(value, master: torch.Tensor, group: dict):
    """A scalar optimizer state (e.g. `step`) for `master`: capturable / fused optimizers keep it on the
    parameter's device, others on the CPU."""
    if isinstance(value, torch.Tensor):
        value = value.clone()
        if group.get("capturable") or group.get("fused"):
            value = value.to(master.device)
    return value


def state_dtype(saved: torch.dtype, master: torch.Tensor) -> torch.dtype:
    """An elementwise optimizer state loads in its master's dtype (Note [bf16 masters]: bf16 states next to
    bf16 masters, fp32 next to fp32 ones, whichever the checkpoint was saved with); others as saved."""
    return master.dtype if saved.is_floating_point and master.is_floating_point() else saved


@torch.no_grad()
def fill_from_universal(entries: list[ShardEntry], uni: UniversalState, optimizer, with_optimizer: bool) -> None:
    """This rank's masters (and, `with_optimizer`, their elementwise and scalar optimizer states) cut out of
    the universal form's full tensors (a resharded zerospeed checkpoint, or DeepSpeed's)."""
    groups = entry_groups(optimizer, [e.master for e in entries])
    any_scalars = next(iter(uni.scalars.values()), {})
    # an entry of padding only (a small group's last chunks) still gets zero-filled elementwise states
    any_tensors = next(iter(uni.tensors.values()), {})
    for entry, gi in zip(entries, groups):
        pieces = [p for p in entry.pieces if p.name in uni.tensors]
        fill_entry(entry.master, pieces, {p.name: uni.tensors[p.name][FP32] for p in pieces})
        if not with_optimizer or optimizer is None:
            continue
        if pieces:
            keys = set.intersection(*(set(uni.tensors[p.name]) for p in pieces)) - {FP32}
        else:
            keys = set(any_tensors) - {FP32}
        group = optimizer.param_groups[gi] if gi >= 0 else {}
        scalars = uni.scalars[pieces[0].name] if pieces else any_scalars
        state = {k: scalar_state(v, entry.master, group) for k, v in scalars.items()}
        for key in sorted(keys):
            dtype = state_dtype((uni.tensors[pieces[0].name] if pieces else any_tensors)[key].dtype, entry.master)
            t = torch.zeros(entry.master.shape, dtype=dtype, device=entry.master.device)
            fill_entry(t, pieces, {p.name: uni.tensors[p.name][key] for p in pieces})
            state[key] = t
        optimizer.state[entry.master] = state
