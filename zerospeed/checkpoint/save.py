"""Saving: every rank writes its own shard file, rank 0 the model states and the manifest, `latest` last.

Order of a save (each step finishes on every rank before the next begins):
  1. rank 0 empties the staging directory `.{tag}.partial`;
  2. rank 0 writes mp_rank_00_model_states.pt, every rank its zero_pp_rank_{r}_... file (each through a
     temporary name, fsync and rename) and hashes it;
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

import zerospeed
from zerospeed import comm
from zerospeed.checkpoint.atomic import atomic_torch_save, atomic_write_text, fresh_dir, swap_in_dir
from zerospeed.checkpoint.errors import raise_if_any_rank_failed
from zerospeed.checkpoint.experts import (CheckpointNames, checkpoint_names, expert_spans, is_expert_key,
                                          write_expert_files)
from zerospeed.checkpoint.layout import EntryLayout, RankFile, entry_groups, split_state
from zerospeed.checkpoint.manifest import (FORMAT, FORMAT_VERSION, dtype_name, file_record,
                                           tied_aliases, write_manifest)
from zerospeed.checkpoint.naming import (MODEL_STATES, CheckpointPaths, check_save_dir, default_tag,
                                         optim_states_name)
from zerospeed.checkpoint.rng import capture_rng_state
from zerospeed.checkpoint.tags import agree_on_tag
from zerospeed.zero.stage3.registry import full_shape, owner_of

logger = logging.getLogger(__name__)

# Keys of the model states file that are not client state (DeepSpeed merges client_state at top level).
RESERVED_KEYS = frozenset({
    "module", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "optimizer_type",
    "optimizer_param_groups", "lr_scheduler", "loss_scaler", "data_sampler", "global_steps", "global_samples",
    "skipped_steps", "micro_steps", "gradient_accumulation_steps", "dp_world_size", "mp_world_size",
    "zero_stage", "ds_config", "ds_version"})


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
    [global expert names] in checkpoint/experts.py); other per-group reductions are not."""
    if engine.world_size != engine.dp_world_size:
        raise NotImplementedError("checkpoints with model (tensor/pipeline) parallelism are not supported yet: "
                                  f"world size {engine.world_size} != data-parallel size {engine.dp_world_size}")
    if not engine.zero.uniform_reduction and not (experts_ok and expert_spans(engine.module)):
        raise NotImplementedError("checkpoints of models whose param groups reduce over different groups (expert "
                                  "param groups, 'moe': True) are not supported yet: expert weights differ across "
                                  "expert-parallel ranks and would be saved under one name")


def _frozen_names(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def sharded_param_names(module: torch.nn.Module) -> set[str]:
    """Names (tied aliases included) of stage-3 sharded parameters: their values live in the shards."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if owner_of(p) is not None}


def _model_states(engine, client_state: dict, exclude_frozen: bool, spans=()) -> dict:
    module = engine.module
    sd = module.state_dict()
    for name in sharded_param_names(module):  # stage 3: empty placeholders, the shards hold the values
        sd.pop(name, None)
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
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "dp_world_size": engine.dp_world_size, "mp_world_size": 1, "zero_stage": engine.zero.stage,
        "ds_config": engine.config.model_dump(mode="json"), "ds_version": zerospeed.__version__,
    }
    states.update(client_state)
    return states


def _rank_states(engine, rank: int, names: CheckpointNames) -> tuple[dict, list[EntryLayout]]:
    """This rank's shard (its entries; when every rank holds the same state, only rank 0's — and, with
    MoE layers, each expert's from rank 0 of its expert-data-parallel group) and RNG."""
    entries = engine.zero.shard_entries(names.params)
    if engine.zero.replicated_state:
        entries = [e for e in entries if _writes_replicated(e, rank, names.spans)]
    opt = engine.optimizer
    records, layouts = [], []
    for entry, group in zip(entries, entry_groups(opt, [e.master for e in entries])):
        state = opt.state.get(entry.master, {}) if opt is not None else {}
        elementwise, scalars = split_state(state, entry.master.numel())
        records.append({"master": compact(entry.master.reshape(-1)),
                        "state": {**{k: compact(state[k].reshape(-1)) for k in elementwise},
                                  **{k: state[k] for k in scalars}}})
        layouts.append(EntryLayout(group, entry.master.numel(), tuple(entry.pieces), tuple(elementwise),
                                   tuple(scalars)))
    return {"rank": rank, "dp_world_size": engine.dp_world_size, "zero_stage": engine.zero.stage,
            "entries": records, "rng": capture_rng_state(), "ds_version": zerospeed.__version__}, layouts


def _writes_replicated(entry, rank: int, spans) -> bool:
    """Whether this rank saves `entry` of a replicated (stage-0) state: a dense entry from rank 0, an
    expert's from rank 0 of its expert-data-parallel group."""
    owner = next((s for s in spans for p in entry.pieces if p.name.startswith(s.prefix + ".")), None)
    return owner.writer if owner is not None else rank == 0


def _manifest(engine, tag: str, files: dict, partition: list[RankFile], excluded: list[str],
              names: CheckpointNames) -> dict:
    module = engine.module
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "zerospeed_version": zerospeed.__version__,
        "torch_version": torch.__version__, "tag": tag, "created_unix": time.time(),
        "world_size": engine.world_size, "dp_world_size": engine.dp_world_size, "zero_stage": engine.zero.stage,
        "parallel_layout": {"data_parallel": engine.dp_world_size, "tensor_parallel": 1, "pipeline_parallel": 1},
        "param_dtype": dtype_name(engine.precision.param_dtype), "master_dtype": "float32",
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

    Every rank must call it. The checkpoint loads at any world size and ZeRO stage (see
    `load_checkpoint`); `client_state` (a dict) comes back from the load.
    """
    root = check_save_dir(save_dir)
    _check_supported(engine, experts_ok=True)
    names = checkpoint_names(engine.module)  # collective with MoE layers (Note [global expert names])
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
    try:
        if rank == 0:
            model_states = _model_states(engine, client_state, exclude_frozen_parameters, names.spans)
            atomic_torch_save(model_states, paths.staging / MODEL_STATES)
            del model_states
            files[MODEL_STATES] = file_record(paths.staging / MODEL_STATES)
        with engine.zero.resident(engine.optimizer):  # NVMe-offloaded state: in memory while it is written
            shard, layouts = _rank_states(engine, rank, names)
            name = optim_states_name(rank)
            atomic_torch_save(shard, paths.staging / name)
            del shard
        files[name] = file_record(paths.staging / name)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it, or the others hang
        error = f"rank {rank} could not write its checkpoint files in {paths.staging}: {exc}"
    raise_if_any_rank_failed(error)
    expert_files, error = write_expert_files(engine.module, names.spans, paths.staging)  # collective at stage 3
    files.update(expert_files)
    raise_if_any_rank_failed(error)

    gathered = comm.all_gather_object((files, [e.to_json() for e in layouts]))
    if rank == 0:
        try:
            all_files = {k: v for f, _ in gathered for k, v in f.items()}
            partition = [RankFile.from_json({"rank": r, "file": optim_states_name(r), "entries": lay})
                         for r, (_, lay) in enumerate(gathered)]
            excluded = _frozen_names(engine.module) if exclude_frozen_parameters else []
            write_manifest(paths.staging, _manifest(engine, tag, all_files, partition, excluded, names))
            swap_in_dir(paths.staging, paths.dir, paths.previous)
        except OSError as exc:
            error = f"could not finish checkpoint {paths.dir}: {exc}"
    raise_if_any_rank_failed(error)
    if save_latest and rank == 0:
        atomic_write_text(paths.latest, tag)
    comm.barrier()
    logger.info("saved checkpoint %s (%d rank files) in %.2fs", paths.dir, engine.dp_world_size,
                time.perf_counter() - start)
    return True


def without_frozen(engine, state: dict, exclude: bool = True) -> dict:
    """`state` without the entries of parameters that do not require grad (when `exclude`)."""
    if not exclude:
        return state
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Collective: rank 0 writes the module's state dict, in its training dtype, to save_dir/save_filename
    (without parameters that do not require grad, with `exclude_frozen_parameters`)."""
    _check_supported(engine)
    error = None
    # collective: sharded weights are gathered unit by unit onto rank 0
    state = without_frozen(engine, engine.zero.full_state_dict(), exclude_frozen_parameters)
    if comm.get_rank() == 0:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            atomic_torch_save(compact_state_dict(state), Path(save_dir) / save_filename)
        except OSError as exc:
            error = f"save_16bit_model could not write {Path(save_dir) / save_filename}: {exc}"
    raise_if_any_rank_failed(error)
    return True
