"""Loading: any checkpoint into an engine of any data-parallel and tensor-parallel size and ZeRO stage 0-3.

Every rank checks the manifest against its model and verifies the checksums of the files it will
read; a problem on any rank becomes the same error on all of them. A rank whose entries have exactly
the layout of one saved rank file (same world size, tensor-parallel layout and bucketing) copies that
file's tensors; any other layout is filled from the universal form (full per-parameter tensors,
universal.py) of just the parameters its entries touch, cut to this rank's tensor-parallel pieces
(Note [canonical tensors] in tensor_parallel.py) — so a checkpoint loads at any tp degree as well.
Masters are then written back into the model on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.deepspeed_import import is_deepspeed_tag
from zerospeed.checkpoint.deepspeed_load import load_deepspeed_checkpoint
from zerospeed.checkpoint.deepspeed_pickle import readable_deepspeed_objects
from zerospeed.checkpoint.errors import CheckpointError, raise_if_any_rank_failed
from zerospeed.checkpoint.experts import CheckpointNames, is_expert_key, load_expert_files, local_expert_files
from zerospeed.checkpoint.layout import RankFile, entry_groups, partition_from_manifest
from zerospeed.checkpoint.manifest import check_model_compat, read_manifest, saved_layouts, tied_aliases, verify_files
from zerospeed.checkpoint.module_state import SavedModule, local_module_state
from zerospeed.checkpoint.naming import (
    MODEL_STATES,
    UNIVERSAL_INFO,
    CheckpointPaths,
    check_load_dir,
    is_model_states_name,
    optim_states_name,
)
from zerospeed.checkpoint.placement import Placement, check_supported, checkpoint_names, placement, sharded_param_names
from zerospeed.checkpoint.rng import restore_rng_state
from zerospeed.checkpoint.state import DELAYED_UPDATE, RESERVED_KEYS, TrainingState, restore_training_state
from zerospeed.checkpoint.tags import agree_on_tag, read_latest, resolve_tag_dir
from zerospeed.checkpoint.tensor_parallel import layout_problem, reslice
from zerospeed.checkpoint.universal import (
    FP32,
    files_holding,
    fill_from_universal,
    load_entries_file,
    load_universal,
    scalar_state,
    state_dtype,
)
from zerospeed.zero.shards import ShardEntry

logger = logging.getLogger(__name__)


@dataclass
class _ReadList:
    tag_dir: Path
    manifest: dict
    place: Placement
    entries: list[ShardEntry]
    direct: RankFile | None  # a saved rank file laid out exactly like this rank's entries
    names: set[str]  # trainable parameters this rank's entries hold pieces of
    rng_file: str | None
    files: list[str]  # everything this rank reads, to verify first


def _matching_file(manifest: dict, entries: list[ShardEntry], place: Placement) -> RankFile | None:
    if saved_layouts(manifest) != place.layouts:
        return None
    dp_rank = 0 if manifest["replicated"] else place.dp_rank
    candidate = next(
        (rf for rf in partition_from_manifest(manifest) if rf.rank == dp_rank and rf.tp_rank == place.tp_rank), None
    )
    if candidate is None:
        return None
    same = len(candidate.entries) == len(entries) and all(
        lay.numel == e.master.numel() and lay.pieces == tuple(e.pieces) for lay, e in zip(candidate.entries, entries)
    )
    return candidate if same else None


def _model_files(manifest: dict) -> list[str]:
    """The model-states files (MODEL_STATES first): every tp rank's when some tensor is sharded."""
    if not saved_layouts(manifest):
        return [MODEL_STATES]
    return [MODEL_STATES] + sorted(n for n in manifest["files"] if is_model_states_name(n) and n != MODEL_STATES)


def _check_layouts(manifest: dict, place: Placement, tag_dir: Path) -> None:
    """Every sharded parameter of this engine can be cut out of the checkpoint's full tensor."""
    for name, layout in place.layouts.items():
        saved = manifest["parameters"].get(name)
        if saved is not None and (problem := layout_problem(name, saved["shape"], layout, place.tp)) is not None:
            raise CheckpointError(
                f"checkpoint {tag_dir}: {problem} (its full shape in the checkpoint is "
                f"{saved['shape']}); build the model as it was when saved (the same model config "
                "and tensor_parallel.partition_config)"
            )


def _weights_in_shards(state: TrainingState, manifest: dict) -> bool:
    """Trainable weights live only in the shards, not the module state (when saving or loading)."""
    return state.zero.weights_in_shards or manifest["weights_in_shards"]


def _read_list(
    state: TrainingState,
    tag_dir: Path,
    manifest: dict,
    *,
    strict: bool,
    with_optimizer: bool,
    module_only: bool,
    names: CheckpointNames,
    place: Placement,
) -> _ReadList:
    check_model_compat(manifest, state.module, strict=strict, where=tag_dir, specs=names.specs)
    _check_layouts(manifest, place, tag_dir)
    entries = names.global_entries(state.zero.shard_entries(names.params))
    expert_files = local_expert_files(names.spans)
    model_files = _model_files(manifest)
    if module_only and not _weights_in_shards(state, manifest):
        return _ReadList(tag_dir, manifest, place, entries, None, set(), None, model_files + expert_files)
    if with_optimizer:
        _check_optimizer(state.optimizer, manifest, tag_dir)
    saved_trainable = {n for n, s in manifest["parameters"].items() if s["trainable"]}
    names = {p.name for e in entries for p in e.pieces} & saved_trainable
    direct = _matching_file(manifest, entries, place)
    rng_file = optim_states_name(place.dp_rank, place.tp_rank)
    rng_file = rng_file if rng_file in manifest["files"] else None
    files = model_files + ([direct.file] if direct else files_holding(manifest, names))
    files += [rng_file] if rng_file and rng_file not in files else []
    files += expert_files
    return _ReadList(tag_dir, manifest, place, entries, direct, names, rng_file, files)


def _check_optimizer(optimizer, manifest: dict, tag_dir: Path) -> None:
    saved = manifest["optimizer"]
    if optimizer is None:
        return
    if saved["type"] is not None and saved["type"] != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {tag_dir} holds {saved['type']} optimizer state, this engine uses "
            f"{type(optimizer).__name__}; pass load_optimizer_states=False to load the weights only"
        )
    if saved["param_groups"] != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {tag_dir} has {saved['param_groups']} optimizer param groups, this "
            f"engine {len(optimizer.param_groups)}; pass load_optimizer_states=False to load "
            "the weights only"
        )


def _load_module(
    state: TrainingState, states: dict, manifest: dict, strict: bool, where: Path, spans, place: Placement
) -> None:
    module = state.module
    sharded = sharded_param_names(module)  # stage 3: filled from the shards, not the module state
    module_state = local_module_state(
        SavedModule(where, manifest, states),
        layouts=place.layouts,
        tp_rank=place.tp_rank,
        tp=place.tp,
        tied=tied_aliases(module),
        skip=sharded,
    )
    result = module.load_state_dict(module_state, strict=False)
    _load_frozen(state, SavedModule(where, manifest, states), place, sharded)
    if spans:  # Note [global expert names]: this rank's experts come from their own files
        load_expert_files(module, spans, where, skip=sharded)
    excluded = set(manifest.get("excluded_frozen", ())) | sharded
    excluded |= {k for k in result.missing_keys if is_expert_key(k, spans)}
    if manifest["weights_in_shards"]:  # such a checkpoint keeps trainable parameters in its shards only
        excluded |= {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    missing = [k for k in result.missing_keys if k not in excluded]
    if strict and (missing or result.unexpected_keys):
        raise CheckpointError(
            f"checkpoint {where}: module state does not match the model — missing {missing}, "
            f"unexpected {list(result.unexpected_keys)} (load_module_strict=False to allow)"
        )


def _load_frozen(state: TrainingState, saved: SavedModule, place: Placement, sharded: set[str]) -> None:
    """Stage 3's partitioned frozen parameters: each rank cuts its chunk out of the whole values the
    model states hold (Note [partitioned frozen parameters], zero/stage3/strategy.py)."""
    module = state.module
    frozen = {
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if n in sharded and not p.requires_grad and n in saved
    }
    if not frozen:
        return
    values = local_module_state(
        saved,
        layouts=place.layouts,
        tp_rank=place.tp_rank,
        tp=place.tp,
        tied=tied_aliases(module),
        skip=set(saved.keys()) - frozen,
    )
    params = dict(module.named_parameters(remove_duplicate=False))
    state.zero.load_frozen({id(params[n]): v for n, v in values.items()})


@torch.no_grad()
def _load_direct(reads: _ReadList, optimizer, with_optimizer: bool) -> None:
    data = load_entries_file(reads.tag_dir, reads.direct.file)
    groups = entry_groups(optimizer, [e.master for e in reads.entries])
    for entry, layout, record, gi in zip(reads.entries, reads.direct.entries, data["entries"], groups):
        entry.master.view(-1).copy_(record["master"].reshape(-1))
        if with_optimizer and optimizer is not None:
            group = optimizer.param_groups[gi] if gi >= 0 else {}
            optimizer.state[entry.master] = {
                k: (
                    v.to(entry.master.device, state_dtype(v.dtype, entry.master)).view(entry.master.shape).clone()
                    if k in layout.elementwise
                    else scalar_state(v, entry.master, group)
                )
                for k, v in record["state"].items()
            }


@torch.no_grad()
def _load_resharded(reads: _ReadList, optimizer, with_optimizer: bool) -> None:
    uni = load_universal(reads.tag_dir, reads.manifest, names=reads.names, keys=None if with_optimizer else {FP32})
    place = reads.place
    for name, full in uni.tensors.items():  # this rank's tensor-parallel piece of each full tensor
        uni.tensors[name] = {k: reslice(t, place.layouts.get(name), place.tp_rank) for k, t in full.items()}
    fill_from_universal(reads.entries, uni, optimizer, with_optimizer)


def _restore_rng(reads: _ReadList) -> None:
    if reads.rng_file is not None:
        with readable_deepspeed_objects():
            rng = torch.load(reads.tag_dir / reads.rng_file, map_location="cpu", mmap=True, weights_only=True)["rng"]
        restore_rng_state(rng)
    else:
        logger.warning(
            "checkpoint %s was saved by %d ranks: rank %d has no saved RNG state and keeps its own",
            reads.tag_dir,
            reads.manifest["world_size"],
            comm.get_rank(),
        )


def _resolve(state: TrainingState, root: Path, tag, universal: bool = False) -> str | None:
    if tag is None:
        if universal:  # checkpoint.load_universal: DeepSpeed names the universal folder in `latest_universal`
            latest = root / "latest_universal"
            tag = latest.read_text().strip() if latest.is_file() else None
        else:
            latest, tag = root / "latest", read_latest(root)
        if not all(t is not None for t in comm.all_gather_object(tag)):
            logger.warning(
                "load_checkpoint: there is no %s file naming a tag; nothing loaded (pass tag= to "
                "load a specific checkpoint)",
                latest,
            )
            return None
    return agree_on_tag(str(tag), state.tag_validation)


def load_checkpoint(
    state: TrainingState,
    load_dir,
    tag=None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    async_load: bool = False,
    universal: bool = False,
):
    """Collective: restore a checkpoint saved at any world size, tensor-parallel degree and ZeRO stage 0-3
    into `state` (the engine's `TrainingState`). `async_load` (the config key): this rank's files are read
    and checked on parallel threads (manifest.verify_files). `universal` (checkpoint.load_universal): without
    `tag`, the tag `latest_universal` names (a DeepSpeed universal folder, Note [universal folders]).

    Returns (path of the model states file, client_state), or (None, None) with a warning when
    `tag` is None and `load_dir` has no `latest` file.
    """
    root = check_load_dir(load_dir)
    check_supported(state, experts_ok=True, hand_split_ok=True)  # (a DeepSpeed tag may say the split: below)
    tag = _resolve(state, root, tag, universal)
    if tag is None:
        return None, None
    paths = CheckpointPaths(root, tag)
    if paths.dir.is_dir() and is_deepspeed_tag(paths.dir):  # Note [DeepSpeed checkpoints]
        return load_deepspeed_checkpoint(
            state,
            paths.dir,
            strict=load_module_strict,
            with_optimizer=load_optimizer_states and not load_module_only,
            with_scheduler=load_lr_scheduler_states and not load_module_only,
            module_only=load_module_only,
        )
    check_supported(state, experts_ok=True)  # (zerospeed's own checkpoints: the model's layers say the split)
    place = placement(state)
    names = checkpoint_names(state, place)  # collective with MoE layers (Note [global expert names])
    start = time.perf_counter()
    with_optimizer = load_optimizer_states and not load_module_only
    reads, error = None, None
    try:
        tag_dir = resolve_tag_dir(CheckpointPaths(root, tag))
        manifest = read_manifest(tag_dir)
        reads = _read_list(
            state,
            tag_dir,
            manifest,
            strict=load_module_strict,
            with_optimizer=with_optimizer,
            module_only=load_module_only,
            names=names,
            place=place,
        )
        if (problem := verify_files(tag_dir, manifest, reads.files, workers=4 if async_load else 1)) is not None:
            raise CheckpointError(problem)
    except CheckpointError as exc:
        error = str(exc)
    raise_if_any_rank_failed(error)

    states = None
    with state.zero.resident(state.optimizer):  # NVMe-offloaded masters and states: in memory for the load
        states = _load_states(state, reads, with_optimizer, load_module_only, load_module_strict, names.spans)
    if not load_module_only:
        restore_training_state(state, states, with_optimizer=with_optimizer, with_scheduler=load_lr_scheduler_states)
        _restore_rng(reads)
    comm.barrier()
    logger.info(
        "loaded checkpoint %s (%s) in %.2fs",
        reads.tag_dir,
        "same layout" if reads.direct is not None else "resharded",
        time.perf_counter() - start,
    )
    client_state = {k: v for k, v in states.items() if k not in RESERVED_KEYS}
    if client_state.get("universal_checkpoint_info") == UNIVERSAL_INFO:  # written by the save, not the client
        client_state.pop("universal_checkpoint_info")
    return str(reads.tag_dir / MODEL_STATES), client_state


def _load_states(
    state: TrainingState,
    reads: _ReadList,
    with_optimizer: bool,
    load_module_only: bool,
    load_module_strict: bool,
    spans=(),
):
    states, error = None, None
    try:
        states = torch.load(reads.tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
        _load_module(state, states, reads.manifest, load_module_strict, reads.tag_dir, spans, reads.place)
        state.zero.load_masters_from_params()
        # weights kept only in the shards: a module-only load reads their masters too
        if not load_module_only or _weights_in_shards(state, reads.manifest):
            (_load_direct if reads.direct is not None else _load_resharded)(reads, state.optimizer, with_optimizer)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it before the collective below
        error = f"rank {comm.get_rank()}: loading {reads.tag_dir} failed: {type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(error)
    if (not load_module_only or _weights_in_shards(state, reads.manifest)) and not _keeps_pending_update(
        state, states, reads.manifest, with_optimizer
    ):
        state.zero.sync_params_from_masters()
    return states


def _keeps_pending_update(state: TrainingState, states: dict, manifest: dict, with_optimizer: bool) -> bool:
    """Note [delayed update in checkpoints] (offload/delayed_update.py): with the delayed parameter update on,
    its record comes back (none without the optimizer states); True when the checkpoint holds an update not
    yet published: the weights stay the module state's, one update behind the loaded masters."""
    if state.delayed_update is None:
        return False
    keep = with_optimizer and not manifest["weights_in_shards"]  # (the module state holds every weight)
    state.delayed_update.load_state_dict(states.get(DELAYED_UPDATE) if keep else None)
    return state.delayed_update.pending
