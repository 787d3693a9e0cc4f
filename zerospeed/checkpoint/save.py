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

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed.version import __version__
from zerospeed import comm
from zerospeed.checkpoint.atomic import atomic_torch_save, atomic_write_text, fresh_dir, swap_in_dir
from zerospeed.checkpoint.errors import raise_if_any_rank_failed
from zerospeed.checkpoint.experts import (CheckpointNames, checkpoint_names, expert_spans, is_expert_key,
                                          write_expert_files)
from zerospeed.checkpoint.layout import EntryLayout, RankFile, entry_groups, split_state
from zerospeed.checkpoint.manifest import (FORMAT, FORMAT_VERSION, PLAIN_FORMAT_VERSION, dtype_name, file_record,
                                           tied_aliases, write_manifest)
from zerospeed.checkpoint.naming import (CheckpointPaths, check_save_dir, default_tag, model_states_name,
                                         optim_states_name)
from zerospeed.checkpoint.rng import capture_rng_state
from zerospeed.checkpoint.tags import agree_on_tag
from zerospeed.checkpoint.tensor_parallel import (Layouts, canonical_shape, layouts_to_json, model_layouts,
                                                  pack_pieces, writes)
from zerospeed.zero.stage3.registry import full_shape, owner_of

logger = logging.getLogger(__name__)

# Keys of the model states file that are not client state (DeepSpeed merges client_state at top level).
RESERVED_KEYS = frozenset({
    "module", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "optimizer_type",
    "optimizer_param_groups", "lr_scheduler", "loss_scaler", "data_sampler", "global_steps", "global_samples",
    "skipped_steps", "micro_steps", "gradient_accumulation_steps", "dp_world_size", "mp_world_size",
    "zero_stage", "ds_config", "ds_version", "random_ltd"})


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


def _check_supported(engine, experts_ok: bool = False) -> None:
    """`experts_ok`: MoE layers' expert groups are fine (save/load_checkpoint name them globally, Note
    [global expert names] in checkpoint/experts.py); other per-group reductions are not. Tensor
    parallelism is fine when zerospeed's tensor-parallel layers (AutoTP, parallel.tensor) say how each
    parameter is split (Note [canonical tensors] in tensor_parallel.py)."""
    mesh = engine.mesh
    tp = mesh.size("tp")
    if mesh.size("pp") > 1:
        raise NotImplementedError("this engine has pipeline stages: its checkpoints are the pipeline engine's "
                                  "(zerospeed.parallel.pipeline.checkpoint), not these")
    if engine.world_size != zero_dp_size(engine) * tp:
        raise NotImplementedError(f"checkpoints of this engine's layout are not supported: world size "
                                  f"{engine.world_size} != sequence-data-parallel size {zero_dp_size(engine)} x "
                                  f"tensor-parallel size {tp}")
    if tp > 1:
        _check_tensor_parallel(engine, tp)
        return
    # Note [MiCS]: shard-group partitions are whole dense partitions, each written by every replica alike
    mics = any(u.replicas > 1 for u in engine.zero.units)
    if not engine.zero.uniform_reduction and not mics and not (experts_ok and expert_spans(engine.module)):
        raise NotImplementedError("checkpoints of models whose param groups reduce over different groups (expert "
                                  "param groups, 'moe': True) are not supported yet: expert weights differ across "
                                  "expert-parallel ranks and would be saved under one name")


def _check_tensor_parallel(engine, tp: int) -> None:
    from zerospeed.parallel.tensor.layers import TensorParallelModule
    if not any(isinstance(m, TensorParallelModule) for m in engine.module.modules()):
        raise NotImplementedError(f"checkpoints of a tensor-parallel engine (tp={tp}) whose model is split by its own "
                                  "code: without zerospeed's tensor-parallel layers (AutoTP's "
                                  '"tensor_parallel": {"autotp_size": N}, or zerospeed.parallel.tensor) the checkpoint '
                                  "cannot know how each parameter is split; use those layers")
    groups = engine.optimizer.param_groups if engine.optimizer is not None else []
    if expert_spans(engine.module) or any(g.get("moe") for g in groups):
        raise NotImplementedError("checkpoints of tensor-parallel models with MoE layers are not supported yet")


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in the checkpoint: its data- and tensor-parallel ranks, and the layouts of the
    model's sharded parameters ({} without tensor parallelism)."""

    dp_rank: int
    tp_rank: int
    tp: int
    layouts: Layouts

    def writes(self, name: str) -> bool:
        """Whether this tp rank saves (its piece of) parameter or buffer `name` (a first name, not an alias)."""
        return writes(self.layouts.get(name), self.tp_rank)


def zero_dp_size(engine) -> int:
    """Note [sequence-parallel checkpoints]: the checkpoint's data-parallel size is that of the group the
    ZeRO state is partitioned over, data x sequence ranks (`dp_sp`; just `dp` without sequence
    parallelism). Ulysses shards activations, never weights: the sp ranks of a replica hold the same
    model and each holds its own slice of the dp x sp-way partitioned optimizer state, so a checkpoint
    saved at sp = P is the checkpoint of a dp x P-way data-parallel run — one rank file per dp x sp rank,
    named by its rank in that group (as DeepSpeed names them by the sequence-data-parallel rank) — and
    loads, resharded, at any other dp / sp / tp split and ZeRO stage."""
    return engine.mesh.size("dp_sp")


def placement(engine) -> Placement:
    mesh = engine.mesh
    return Placement(mesh.rank_in("dp_sp"), mesh.rank_in("tp"), mesh.size("tp"), model_layouts(engine.module))


def engine_names(engine, place: Placement) -> CheckpointNames:
    """`checkpoint_names`, with each sharded parameter's canonical full shape (Note [canonical tensors])."""
    names = checkpoint_names(engine.module)  # collective with MoE layers (Note [global expert names])
    if not place.layouts:
        return names
    specs = {n: {**s, "shape": canonical_shape(s["shape"], place.layouts.get(n), place.tp_rank)}
             for n, s in names.specs.items()}
    return dataclasses.replace(names, specs=specs)


def _frozen_names(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def sharded_param_names(module: torch.nn.Module) -> set[str]:
    """Names (tied aliases included) of stage-3 sharded parameters: their values live in the shards."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if owner_of(p) is not None}


def _model_states(engine, client_state: dict, exclude_frozen: bool, spans=(),
                  place: Placement | None = None, frozen: dict | None = None) -> dict:
    """`frozen`: id(parameter) -> full value of stage 3's partitioned frozen parameters, which the model
    states hold whole (`engine.zero.frozen_values`, gathered by every rank beforehand)."""
    module = engine.module
    sharded = sharded_param_names(module)  # stage 3: empty placeholders, the shards hold the values
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = frozen or {}
    sd = {k: (frozen[id(params[k])] if k in sharded else v) for k, v in module.state_dict().items()
          if k not in sharded or id(params[k]) in frozen}
    if place is not None and place.tp > 1:  # each distinct piece once: replicated tensors from tp rank 0
        tied = tied_aliases(module)
        sd = {k: v for k, v in sd.items() if place.writes(tied.get(k, k))}
    for name in [k for k in sd if is_expert_key(k, spans)]:  # experts have files of their own
        sd.pop(name)
    if exclude_frozen:
        for name in _frozen_names(module):
            sd.pop(name, None)
    opt = engine.optimizer
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    states = {
        "module": compact_state_dict(sd),
        "buffer_names": [n for n in module.state_dict() if n not in param_names],
        "param_shapes": {n: list(full_shape(p)) for n, p in module.named_parameters() if p.requires_grad},
        "frozen_param_shapes": {n: list(full_shape(p)) for n, p in module.named_parameters() if not p.requires_grad},
        "shared_params": tied_aliases(module),
        "optimizer_type": type(opt).__name__ if opt is not None else None,
        "optimizer_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if opt is not None else [],
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "data_sampler": engine.training_dataloader.state_dict() if engine.training_dataloader is not None else None,
        "random_ltd": engine.random_ltd_scheduler.state_dict() if engine.random_ltd_scheduler is not None else None,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "dp_world_size": zero_dp_size(engine), "mp_world_size": engine.mesh.size("tp"),
        "zero_stage": engine.zero.stage,
        "ds_config": engine.config.model_dump(mode="json"), "ds_version": __version__,
    }
    states.update(client_state)
    return states


def _rank_states(engine, place: Placement, names: CheckpointNames) -> tuple[dict, list[EntryLayout]]:
    """This rank's shard (its entries; when every rank holds the same state, only data-parallel rank 0's —
    and, with MoE layers, each expert's from rank 0 of its expert-data-parallel group; under tensor
    parallelism only the pieces this tp rank writes) and RNG."""
    entries = names.global_entries(engine.zero.shard_entries(names.params))
    opt = engine.optimizer
    groups = entry_groups(opt, [e.master for e in entries])
    if engine.zero.replicated_state:
        kept = [i for i, e in enumerate(entries) if _writes_replicated(e, place.dp_rank, names.spans)]
        entries, groups = [entries[i] for i in kept], [groups[i] for i in kept]
    records, layouts = [], []
    for entry, group in zip(entries, groups):
        state = opt.state.get(entry.master, {}) if opt is not None else {}
        elementwise, scalars = split_state(state, entry.master.numel())
        keep = {p.name for p in entry.pieces if place.writes(p.name)}
        if not keep and entry.pieces:
            continue  # every piece is another tp rank's to save
        master, pieces = pack_pieces(entry.master.reshape(-1), entry.pieces, keep)
        records.append({"master": compact(master),
                        "state": {**{k: compact(pack_pieces(state[k].reshape(-1), entry.pieces, keep)[0])
                                     for k in elementwise},
                                  **{k: state[k] for k in scalars}}})
        layouts.append(EntryLayout(group, master.numel(), tuple(pieces), tuple(elementwise), tuple(scalars)))
    return {"rank": place.dp_rank, "tp_rank": place.tp_rank, "dp_world_size": zero_dp_size(engine),
            "zero_stage": engine.zero.stage, "entries": records, "rng": capture_rng_state(),
            "ds_version": __version__}, layouts


def _writes_replicated(entry, rank: int, spans) -> bool:
    """Whether this rank saves `entry` of a replicated (stage-0) state: a dense entry from rank 0, an
    expert's from rank 0 of its expert-data-parallel group."""
    owner = next((s for s in spans for p in entry.pieces if p.name.startswith(s.prefix + ".")), None)
    return owner.writer if owner is not None else rank == 0


def _parallel_layout(engine, place: Placement) -> dict:
    layout = {"data_parallel": zero_dp_size(engine), "tensor_parallel": place.tp, "pipeline_parallel": 1}
    if engine.mesh.size("sp") > 1:  # (Note [sequence-parallel checkpoints]: data_parallel counts dp x sp)
        layout["sequence_parallel"] = engine.mesh.size("sp")
    if place.layouts:  # Note [canonical tensors]: how each sharded parameter's pieces make its full tensor
        layout["shard_specs"] = layouts_to_json(place.layouts)
    return layout


def _manifest(engine, tag: str, files: dict, partition: list[RankFile], excluded: list[str],
              names: CheckpointNames, place: Placement) -> dict:
    module = engine.module
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION if place.layouts else PLAIN_FORMAT_VERSION,
        "zerospeed_version": __version__,
        "torch_version": torch.__version__, "tag": tag, "created_unix": time.time(),
        "world_size": engine.world_size, "dp_world_size": zero_dp_size(engine), "zero_stage": engine.zero.stage,
        "parallel_layout": _parallel_layout(engine, place),
        "param_dtype": dtype_name(engine.precision.param_dtype), "master_dtype": dtype_name(engine.precision.master_dtype),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "optimizer": {"type": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
                      "param_groups": len(engine.optimizer.param_groups) if engine.optimizer is not None else 0},
        "parameters": names.specs, "tied": tied_aliases(module),
        "module_keys": names.module_keys, "excluded_frozen": excluded,
        # rank 0's entries stand for every rank (not with experts: each expert's come from its own ranks)
        "replicated": engine.zero.replicated_state and not names.has_experts,
        "weights_in_shards": engine.zero.weights_in_shards,  # the module state holds no trainable weights
        "partition": [rf.to_json() for rf in partition],
        "files": files,
    }


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Collective: save the engine's full training state under `save_dir/tag` (default global_step{N}).

    Every rank must call it. The checkpoint loads at any world size, tensor-parallel degree and ZeRO
    stage (see `load_checkpoint`); `client_state` (a dict) comes back from the load.
    """
    root = check_save_dir(save_dir)
    _check_supported(engine, experts_ok=True)
    place = placement(engine)
    names = engine_names(engine, place)  # collective with MoE layers (Note [global expert names])
    client_state = dict(client_state or {})
    clash = sorted(RESERVED_KEYS & set(client_state))
    if clash:
        raise ValueError(f"save_checkpoint: client_state keys {clash} are reserved for the checkpoint's own "
                         "contents; rename them")
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        logger.warning("save_checkpoint in the middle of a gradient accumulation window: the partial "
                       "gradients are not saved")
    tag = agree_on_tag(str(tag) if tag is not None else default_tag(engine.global_steps),
                       engine.config.checkpoint.tag_validation)
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
    frozen = engine.zero.frozen_values(keep=place.dp_rank == 0) if not exclude_frozen_parameters else {}
    try:
        if place.dp_rank == 0:
            model_states = _model_states(engine, client_state, exclude_frozen_parameters, names.spans, place,
                                         frozen)
            name = model_states_name(place.tp_rank)
            atomic_torch_save(model_states, paths.staging / name)
            del model_states
            files[name] = file_record(paths.staging / name)
        with engine.zero.resident(engine.optimizer):  # NVMe-offloaded state: in memory while it is written
            shard, layouts = _rank_states(engine, place, names)
            name = optim_states_name(place.dp_rank, place.tp_rank)
            atomic_torch_save(shard, paths.staging / name)
            del shard
        files[name] = file_record(paths.staging / name)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it, or the others hang
        error = f"rank {rank} could not write its checkpoint files in {paths.staging}: {exc}"
    raise_if_any_rank_failed(error)
    expert_files, error = write_expert_files(engine.module, names.spans, paths.staging)  # collective at stage 3
    files.update(expert_files)
    raise_if_any_rank_failed(error)

    gathered = comm.all_gather_object((files, [e.to_json() for e in layouts], place.dp_rank, place.tp_rank))
    if rank == 0:
        try:
            all_files = {k: v for f, *_ in gathered for k, v in f.items()}
            partition = sorted((RankFile.from_json({"rank": d, "tp_rank": t, "file": optim_states_name(d, t),
                                                    "entries": lay}) for _, lay, d, t in gathered),
                               key=lambda rf: (rf.tp_rank, rf.rank))
            excluded = _frozen_names(engine.module) if exclude_frozen_parameters else []
            write_manifest(paths.staging, _manifest(engine, tag, all_files, partition, excluded, names, place))
            swap_in_dir(paths.staging, paths.dir, paths.previous)
        except OSError as exc:
            error = f"could not finish checkpoint {paths.dir}: {exc}"
    raise_if_any_rank_failed(error)
    if save_latest and rank == 0:
        atomic_write_text(paths.latest, tag)
    comm.barrier()
    logger.info("saved checkpoint %s (%d rank files) in %.2fs", paths.dir, engine.world_size,
                time.perf_counter() - start)
    return True


def _autoep_only(engine) -> bool:
    """The model's experts are all AutoEP's stacked ones (Note [stacked expert checkpoints])."""
    spans = expert_spans(engine.module)
    return bool(spans) and all(span.stacked for span in spans)


def without_frozen(engine, state: dict, exclude: bool = True) -> dict:
    """`state` without the entries of parameters that do not require grad (when `exclude`)."""
    if not exclude:
        return state
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def _full_16bit_state(engine) -> dict:
    """Collective: the whole model's state dict in its training dtype on rank 0 — stage-3 weights gathered
    unit by unit; tensor-parallel ones gathered over the tp group into the layout of the model before
    sharding (`parallel.tensor.full_state_dict`), so the file loads into the plain model."""
    if _autoep_only(engine):  # every expert gathered over its expert-parallel group, transformers' layout
        from zerospeed.moe.autoep import consolidated_state_dict
        from zerospeed.zero import GatheredParameters
        with GatheredParameters(list(engine.module.parameters())):
            state = consolidated_state_dict(engine.module)
            return {k: v.detach().cpu().clone() for k, v in state.items()} if comm.get_rank() == 0 else {}
    if engine.mesh.size("tp") == 1:
        return engine.zero.full_state_dict()
    from zerospeed.parallel.tensor.state import full_state_dict
    from zerospeed.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        state = full_state_dict(engine.module, engine.mesh.group("tp"))
    return state if comm.get_rank() == 0 else {}


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Collective: rank 0 writes the module's state dict, in its training dtype, to save_dir/save_filename
    (without parameters that do not require grad, with `exclude_frozen_parameters`)."""
    _check_supported(engine, experts_ok=_autoep_only(engine))
    error = None
    state = without_frozen(engine, _full_16bit_state(engine), exclude_frozen_parameters)
    if comm.get_rank() == 0:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            atomic_torch_save(compact_state_dict(state), Path(save_dir) / save_filename)
        except OSError as exc:
            error = f"save_16bit_model could not write {Path(save_dir) / save_filename}: {exc}"
    raise_if_any_rank_failed(error)
    return True
