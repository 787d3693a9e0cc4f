"""Saving: every rank writes its own shard file, rank 0 the model states and the manifest, `latest` last.

Order of a save (each step finishes on every rank before the next begins):
  1. rank 0 empties the staging directory `.{tag}.partial`;
  2. data-parallel rank 0 of each tensor-parallel rank t writes mp_rank_{t:02d}_model_states.pt, every
     rank its zero_pp_rank_{d}_mp_rank_{t:02d}_... file (each through a temporary name, fsync and
     rename) and hashes it;
  3. rank 0 gathers the hashes and partition maps, writes the manifest and renames the staging
     directory to `{tag}` (Note [tag directory swap] in atomic.py);
  4. after a barrier, rank 0 rewrites `latest`.
A process killed at any point leaves `latest` naming a complete checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.atomic import atomic_torch_save, fresh_dir, swap_in_dir
from zerospeed.checkpoint.errors import raise_if_any_rank_failed
from zerospeed.checkpoint.experts import CheckpointNames, expert_spans, is_expert_key, write_expert_files
from zerospeed.checkpoint.layout import EntryLayout, RankFile, entry_groups, split_state
from zerospeed.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    PLAIN_FORMAT_VERSION,
    dtype_name,
    file_record,
    tied_aliases,
    write_manifest,
)
from zerospeed.checkpoint.naming import (
    CheckpointPaths,
    check_save_dir,
    default_tag,
    model_states_name,
    optim_states_name,
)
from zerospeed.checkpoint.placement import (
    Placement,
    check_supported,
    checkpoint_names,
    placement,
    sharded_param_names,
    zero_dp_size,
)
from zerospeed.checkpoint.protocols import full_model_state
from zerospeed.checkpoint.rng import capture_rng_state
from zerospeed.checkpoint.state import TrainingState, training_state_dict
from zerospeed.checkpoint.tags import agree_on_tag
from zerospeed.checkpoint.tensor_parallel import layouts_to_json, pack_pieces
from zerospeed.utils.files import atomic_write_text
from zerospeed.version import __version__
from zerospeed.zero import GatheredParameters
from zerospeed.zero.tags import full_shape

logger = logging.getLogger(__name__)

# Keys of the model states file that are not client state (DeepSpeed merges client_state at top level).
RESERVED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "optimizer_type",
        "optimizer_param_groups",
        "lr_scheduler",
        "loss_scaler",
        "data_sampler",
        "global_steps",
        "global_samples",
        "skipped_steps",
        "micro_steps",
        "gradient_accumulation_steps",
        "dp_world_size",
        "mp_world_size",
        "zero_stage",
        "ds_config",
        "ds_version",
        "random_ltd",
    }
)


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, cloned only when it views a larger storage (torch.save writes whole storages:
    a parameter that is a view into a flat ZeRO bucket would otherwise drag the bucket along)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone()


def compact_state_dict(sd: dict) -> dict:
    """`compact` applied to every tensor; tensors that were the same stay one tensor (tied weights)."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
            if key not in seen:
                seen[key] = compact(v)
            out[k] = seen[key]
        else:
            out[k] = v
    return out


def _frozen_names(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def _model_states(
    state: TrainingState,
    client_state: dict,
    exclude_frozen: bool,
    spans=(),
    place: Placement | None = None,
    frozen: dict | None = None,
) -> dict:
    """`frozen`: id(parameter) -> full value of stage 3's partitioned frozen parameters, which the model
    states hold whole (`state.zero.frozen_values`, gathered by every rank beforehand)."""
    module = state.module
    sharded = sharded_param_names(module)  # stage 3: empty placeholders, the shards hold the values
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = frozen or {}
    sd = {
        k: (frozen[id(params[k])] if k in sharded else v)
        for k, v in module.state_dict().items()
        if k not in sharded or id(params[k]) in frozen
    }
    if place is not None and place.tp > 1:  # each distinct piece once: replicated tensors from tp rank 0
        tied = tied_aliases(module)
        sd = {k: v for k, v in sd.items() if place.writes(tied.get(k, k))}
    for name in [k for k in sd if is_expert_key(k, spans)]:  # experts have files of their own
        sd.pop(name)
    if exclude_frozen:
        for name in _frozen_names(module):
            sd.pop(name, None)
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    states = {
        "module": compact_state_dict(sd),
        "buffer_names": [n for n in module.state_dict() if n not in param_names],
        "param_shapes": {n: list(full_shape(p)) for n, p in module.named_parameters() if p.requires_grad},
        "frozen_param_shapes": {n: list(full_shape(p)) for n, p in module.named_parameters() if not p.requires_grad},
        "shared_params": tied_aliases(module),
        **training_state_dict(state),
        "dp_world_size": zero_dp_size(state),
        "mp_world_size": state.mesh.size("tp"),
        "zero_stage": state.zero.stage,
        "ds_config": state.ds_config,
        "ds_version": __version__,
    }
    states.update(client_state)
    return states


def _rank_states(state: TrainingState, place: Placement, names: CheckpointNames) -> tuple[dict, list[EntryLayout]]:
    """This rank's shard (its entries; when every rank holds the same state, only data-parallel rank 0's —
    and, with MoE layers, each expert's from rank 0 of its expert-data-parallel group; under tensor
    parallelism only the pieces this tp rank writes) and RNG."""
    entries = names.global_entries(state.zero.shard_entries(names.params))
    opt = state.optimizer
    groups = entry_groups(opt, [e.master for e in entries])
    if state.zero.replicated_state:
        kept = [i for i, e in enumerate(entries) if _writes_replicated(e, place.dp_rank, names.spans)]
        entries, groups = [entries[i] for i in kept], [groups[i] for i in kept]
    records, layouts = [], []
    for entry, group in zip(entries, groups):
        saved = opt.state.get(entry.master, {}) if opt is not None else {}
        elementwise, scalars = split_state(saved, entry.master.numel())
        keep = {p.name for p in entry.pieces if place.writes(p.name)}
        if not keep and entry.pieces:
            continue  # every piece is another tp rank's to save
        master, pieces = pack_pieces(entry.master.reshape(-1), entry.pieces, keep)
        records.append(
            {
                "master": compact(master),
                "state": {
                    **{k: compact(pack_pieces(saved[k].reshape(-1), entry.pieces, keep)[0]) for k in elementwise},
                    **{k: saved[k] for k in scalars},
                },
            }
        )
        layouts.append(EntryLayout(group, master.numel(), tuple(pieces), tuple(elementwise), tuple(scalars)))
    return {
        "rank": place.dp_rank,
        "tp_rank": place.tp_rank,
        "dp_world_size": zero_dp_size(state),
        "zero_stage": state.zero.stage,
        "entries": records,
        "rng": capture_rng_state(),
        "ds_version": __version__,
    }, layouts


def _writes_replicated(entry, rank: int, spans) -> bool:
    """Whether this rank saves `entry` of a replicated (stage-0) state: a dense entry from rank 0, an
    expert's from rank 0 of its expert-data-parallel group."""
    owner = next((s for s in spans for p in entry.pieces if p.name.startswith(s.prefix + ".")), None)
    return owner.writer if owner is not None else rank == 0


def _parallel_layout(state: TrainingState, place: Placement) -> dict:
    layout = {"data_parallel": zero_dp_size(state), "tensor_parallel": place.tp, "pipeline_parallel": 1}
    if state.mesh.size("sp") > 1:  # (Note [sequence-parallel checkpoints]: data_parallel counts dp x sp)
        layout["sequence_parallel"] = state.mesh.size("sp")
    if place.layouts:  # Note [canonical tensors]: how each sharded parameter's pieces make its full tensor
        layout["shard_specs"] = layouts_to_json(place.layouts)
    return layout


def _manifest(
    state: TrainingState,
    tag: str,
    files: dict,
    partition: list[RankFile],
    excluded: list[str],
    names: CheckpointNames,
    place: Placement,
) -> dict:
    opt, zero = state.optimizer, state.zero
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if place.layouts else PLAIN_FORMAT_VERSION,
        "zerospeed_version": __version__,
        "torch_version": torch.__version__,
        "tag": tag,
        "created_unix": time.time(),
        "world_size": state.mesh.world_size,
        "dp_world_size": zero_dp_size(state),
        "zero_stage": zero.stage,
        "parallel_layout": _parallel_layout(state, place),
        "param_dtype": dtype_name(state.param_dtype),
        "master_dtype": dtype_name(state.master_dtype),
        "global_steps": state.counters.global_steps,
        "global_samples": state.counters.global_samples,
        "optimizer": {
            "type": type(opt).__name__ if opt is not None else None,
            "param_groups": len(opt.param_groups) if opt is not None else 0,
        },
        "parameters": names.specs,
        "tied": tied_aliases(state.module),
        "module_keys": names.module_keys,
        "excluded_frozen": excluded,
        # rank 0's entries stand for every rank (not with experts: each expert's come from its own ranks)
        "replicated": zero.replicated_state and not names.has_experts,
        "weights_in_shards": zero.weights_in_shards,  # the module state holds no trainable weights
        "partition": [rf.to_json() for rf in partition],
        "files": files,
    }


def save_checkpoint(
    state: TrainingState,
    save_dir,
    tag=None,
    client_state=None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Collective: save the full training state under `save_dir/tag` (default global_step{N}).

    Every rank must call it. The checkpoint loads at any world size, tensor-parallel degree and ZeRO
    stage (see `load_checkpoint`); `client_state` (a dict) comes back from the load. `state`: the
    engine's `TrainingState`.
    """
    root = check_save_dir(save_dir)
    check_supported(state, experts_ok=True)
    place = placement(state)
    names = checkpoint_names(state, place)  # collective with MoE layers (Note [global expert names])
    client_state = dict(client_state or {})
    clash = sorted(RESERVED_KEYS & set(client_state))
    if clash:
        raise ValueError(
            f"save_checkpoint: client_state keys {clash} are reserved for the checkpoint's own contents; rename them"
        )
    if state.counters.micro_steps % state.gradient_accumulation_steps != 0:
        logger.warning(
            "save_checkpoint in the middle of a gradient accumulation window: the partial gradients are not saved"
        )
    tag = agree_on_tag(str(tag) if tag is not None else default_tag(state.counters.global_steps), state.tag_validation)
    paths = CheckpointPaths(root, tag)
    rank = comm.get_rank()
    start = time.perf_counter()
    error = None
    if rank == 0:
        try:
            paths.root.mkdir(parents=True, exist_ok=True)
            fresh_dir(paths.staging)
        except OSError as exc:
            error = f"cannot create {paths.staging}: {exc}"
    raise_if_any_rank_failed(error)

    files, layouts = {}, []
    # stage 3's partitioned frozen parameters, whole in the model states (collective)
    frozen = state.zero.frozen_values(keep=place.dp_rank == 0) if not exclude_frozen_parameters else {}
    try:
        if place.dp_rank == 0:
            model_states = _model_states(state, client_state, exclude_frozen_parameters, names.spans, place, frozen)
            name = model_states_name(place.tp_rank)
            atomic_torch_save(model_states, paths.staging / name)
            del model_states
            files[name] = file_record(paths.staging / name)
        with state.zero.resident(state.optimizer):  # NVMe-offloaded state: in memory while it is written
            shard, layouts = _rank_states(state, place, names)
            name = optim_states_name(place.dp_rank, place.tp_rank)
            atomic_torch_save(shard, paths.staging / name)
            del shard
        files[name] = file_record(paths.staging / name)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it, or the others hang
        error = f"rank {rank} could not write its checkpoint files in {paths.staging}: {exc}"
    raise_if_any_rank_failed(error)
    expert_files, error = write_expert_files(state.module, names.spans, paths.staging)  # collective at stage 3
    files.update(expert_files)
    raise_if_any_rank_failed(error)

    gathered = comm.all_gather_object((files, [e.to_json() for e in layouts], place.dp_rank, place.tp_rank))
    if rank == 0:
        try:
            all_files = {k: v for f, *_ in gathered for k, v in f.items()}
            partition = sorted(
                (
                    RankFile.from_json({"rank": d, "tp_rank": t, "file": optim_states_name(d, t), "entries": lay})
                    for _, lay, d, t in gathered
                ),
                key=lambda rf: (rf.tp_rank, rf.rank),
            )
            excluded = _frozen_names(state.module) if exclude_frozen_parameters else []
            write_manifest(paths.staging, _manifest(state, tag, all_files, partition, excluded, names, place))
            swap_in_dir(paths.staging, paths.dir, paths.previous)
        except OSError as exc:
            error = f"could not finish checkpoint {paths.dir}: {exc}"
    raise_if_any_rank_failed(error)
    if save_latest and rank == 0:
        atomic_write_text(paths.latest, tag)
    comm.barrier()
    logger.info(
        "saved checkpoint %s (%d rank files) in %.2fs", paths.dir, state.mesh.world_size, time.perf_counter() - start
    )
    return True


def _autoep_only(state: TrainingState) -> bool:
    """The model's experts are all AutoEP's stacked ones (Note [stacked expert checkpoints])."""
    spans = expert_spans(state.module)
    return bool(spans) and all(span.stacked for span in spans)


def without_frozen(module: torch.nn.Module, state: dict, exclude: bool = True) -> dict:
    """`state` without the entries of `module`'s parameters that do not require grad (when `exclude`)."""
    if not exclude:
        return state
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def _full_16bit_state(state: TrainingState) -> dict:
    """Collective: the whole model's state dict in its training dtype on rank 0 ({} elsewhere). With split
    parameters (tensor-parallel layers, AutoEP's experts) every parameter is gathered whole, in the layout
    of the model before it was split (`protocols.full_model_state`), so the file loads into the plain
    model; otherwise the ZeRO strategy gathers stage-3 weights unit by unit."""
    if not _autoep_only(state) and state.mesh.size("tp") == 1:
        return state.zero.full_state_dict()
    with GatheredParameters(list(state.module.parameters())):
        full = full_model_state(state.module)
    if comm.get_rank() != 0:
        return {}
    on_host: dict[int, torch.Tensor] = {}  # tied names stay one tensor
    for v in full.values():
        if isinstance(v, torch.Tensor) and id(v) not in on_host:
            on_host[id(v)] = v.cpu()
    return {k: on_host[id(v)] if isinstance(v, torch.Tensor) else v for k, v in full.items()}


def save_16bit_model(
    state: TrainingState, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
) -> bool:
    """Collective: rank 0 writes the module's state dict, in its training dtype, to save_dir/save_filename
    (without parameters that do not require grad, with `exclude_frozen_parameters`)."""
    check_supported(state, experts_ok=_autoep_only(state))
    error = None
    full = without_frozen(state.module, _full_16bit_state(state), exclude_frozen_parameters)
    if comm.get_rank() == 0:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            atomic_torch_save(compact_state_dict(full), Path(save_dir) / save_filename)
        except OSError as exc:
            error = f"save_16bit_model could not write {Path(save_dir) / save_filename}: {exc}"
    raise_if_any_rank_failed(error)
    return True
