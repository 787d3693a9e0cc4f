"""Checkpoints of pipeline models: one file per layer, so they load at any number of stages.

Layout of `save_dir/tag/`:

* `layer_XX-model_states.pt` — the layer's module state (tied layers: the shared module, in each of
  their layer files). Written by data-parallel rank 0 of the stage that holds the layer.
* `layer_XX-optim_states.pt` — ZeRO stage 0 only: for each parameter of the layer, its fp32 master
  and optimizer state. Per layer, so optimizer state also reshards to any stage count.
* `zero_pp_rank_S_dp_rank_D_optim_states.pt` — ZeRO stage 1/2: this rank's flat masters and optimizer
  state; they load only into the same layout (stages, data-parallel size, layer split). `pieces` maps
  each master's elements to (layer, parameter name, offsets; under tp the parameter's tp layout), read
  by the export to DeepSpeed.
* `engine_states.pt` — steps, LR scheduler, loss scaler, optimizer hyper-parameters, client state,
  and the layout that wrote the checkpoint.

`latest` (the tag's name) is written last, after every rank finished.

Note [full-layout layer files]: with tensor parallelism inside the stages, a layer's tensors are
gathered over the tp group before they are written (tp rank 0 writes) and each loading rank takes
its own piece by its layers' shard layouts (`zerospeed.parallel.tensor.partition.take`). So the
per-layer files — module states, and at ZeRO stage 0 the fp32 masters and optimizer states — hold
the full model whatever the tp degree that wrote them, and load at any stage count, tp degree and
data-parallel size. ZeRO-1/2 flat files stay per rank (`..._mp_rank_TT_...` under tp) and load into
the same layout only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.async_writer import WriteJob, host_snapshot
from zerospeed.checkpoint.atomic import atomic_torch_save
from zerospeed.checkpoint.deepspeed_pipeline import (
    TIED,
    is_deepspeed_pipeline_tag,
    is_deepspeed_pipeline_universal,
    read_deepspeed_pipeline,
    read_deepspeed_pipeline_universal,
)
from zerospeed.checkpoint.deepspeed_pipeline_tp import (
    is_deepspeed_pipeline_tp_tag,
    read_deepspeed_pipeline_tp,
    read_deepspeed_pipeline_universal_tp,
    tp_piece,
    universal_tp_degree,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.naming import check_load_dir, check_save_dir
from zerospeed.checkpoint.replicated import check_replicated
from zerospeed.checkpoint.save import AsyncSaves
from zerospeed.checkpoint.tensor_parallel import TPLayout
from zerospeed.checkpoint.universal import FP32, UniversalState, fill_from_universal
from zerospeed.parallel.tensor.partition import take
from zerospeed.parallel.tensor.state import gather_full, param_layouts
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.files import atomic_write_text

logger = logging.getLogger(__name__)


def layer_file(idx: int, kind: str = "model") -> str:
    return f"layer_{idx:02d}-{kind}_states.pt"


def _layout(engine) -> dict:
    m = engine.module
    return {
        "num_layers": m.num_layers,
        "pp": m.num_stages,
        "dp": m.grid.dp,
        "tp": m.grid.tp,
        "chunks": m.chunks,
        "bounds": list(m.bounds),
        "zero_stage": engine.zero.stage,
    }


class _TensorParallel:
    """Gathers a layer's tensors to full size and takes a rank's piece back (Note [full-layout layer
    files]); the identity without tensor parallelism."""

    def __init__(self, engine):
        self.group = engine.module.groups.group("tp")
        self.size = engine.module.grid.tp
        self.rank = engine.module.groups.rank_in("tp")
        named = dict(engine.module.named_parameters())
        self.specs = {id(named[n]): specs for n, specs in param_layouts(engine.module).items() if specs is not None}

    def check_replicated(self, engine) -> None:
        """Refuse to save a parameter without a tensor-parallel layout that differs across the tp ranks: it is split
        (a hand-written Megatron-style layer) in a way zerospeed cannot see, and tp rank 0's piece would be written
        as the whole tensor. Collective over the tp group (one small all-gather); every rank raises alike."""
        named = [(n, [p]) for n, p in engine.module.named_parameters() if id(p) not in self.specs]
        check_replicated(named, self.group, self.size)  # Note [hand-split parameters] (checkpoint/replicated.py)

    def layout_json(self, param: torch.Tensor) -> dict | None:
        """How `param`'s full tensor splits over tp (None: replicated), as the saved `tp_layout` records it."""
        specs = self.specs.get(id(param))
        return None if specs is None else TPLayout(tuple(specs)).to_json()

    def full(self, t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        specs = self.specs.get(id(param))
        return t.detach().cpu().clone() if specs is None else gather_full(t, specs, self.group).cpu()

    def piece(self, full: torch.Tensor, param: torch.Tensor, where) -> torch.Tensor:
        specs = self.specs.get(id(param))
        local = full if specs is None else take(full, specs[self.rank])
        if local.shape != param.shape:
            raise ConfigError(
                f"{where}: saved tensor of shape {tuple(full.shape)} does not give this rank's piece "
                f"of shape {tuple(param.shape)} (a different model width or layer list?)"
            )
        return local

    def module_state(self, mod: torch.nn.Module) -> dict:
        params = dict(mod.named_parameters())
        out = {}
        for k, v in mod.state_dict().items():
            out[k] = self.full(v, params[k]) if k in params else v.detach().cpu().clone()
        return out

    def load_module(self, mod: torch.nn.Module, state: dict, where) -> dict:
        params = dict(mod.named_parameters())
        return {k: (self.piece(v, params[k], f"{where} [{k}]") if k in params else v) for k, v in state.items()}


def _param_layers(engine) -> dict[int, list[tuple[int, str]]]:
    """id(parameter) -> [(layer index, name inside the layer's module)] for this rank's layers."""
    out: dict[int, list[tuple[int, str]]] = {}
    for idx in engine.module.local_layer_indices():
        mod = engine.module.layer_module(idx)
        if mod is not None:
            for name, p in mod.named_parameters():
                out.setdefault(id(p), []).append((idx, name))
    return out


def _masters(engine) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
    """(fp32 master, model parameter) pairs at ZeRO stage 0 (one whole parameter each)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    by_name = {n: p for n, p in engine.module.named_parameters()}
    return [(e.master, by_name[e.pieces[0].name]) for e in engine.zero.shard_entries(names)]


def save_pipeline_checkpoint(
    engine, save_dir, tag=None, client_state=None, save_latest: bool = True, saves: PipelineSaves | None = None
) -> bool:
    """Collective. `saves`: the engine's `PipelineSaves`; with an asynchronous writer plan the call returns once
    this rank's files are copied to host memory, and `latest` moves when the save commits (Note [asynchronous
    pipeline saves])."""
    if saves is not None:
        saves.flush()
    root = check_save_dir(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    path = root / tag
    tp = _TensorParallel(engine)
    tp.check_replicated(engine)  # (before anything is written)
    path.mkdir(parents=True, exist_ok=True)
    module, dp_rank = engine.module, comm.get_rank(engine.dp_group)
    writes = tp.rank == 0  # the gathers below are collective over the tp group: every tp rank joins
    parallel = engine.config.checkpoint.parallel_write.pipeline_stage
    files: list[tuple[str, object]] = []  # (name in the tag, object) this rank writes
    for idx in layers_written(
        list(module.local_layer_indices()), dp_rank, comm.get_world_size(engine.dp_group), parallel
    ):
        mod = module.layer_module(idx)
        if mod is not None:
            state = tp.module_state(mod)
            if writes:
                files.append((layer_file(idx), state))
    if dp_rank == 0 and engine.zero.replicated_state and engine.optimizer is not None:
        _save_layer_optim(engine, files, tp, writes)
    if not engine.zero.replicated_state and engine.optimizer is not None:
        entries = engine.zero.shard_entries({id(p): n for n, p in module.named_parameters()})
        masters = [e.master.detach().cpu().clone() for e in entries]
        flat = {"optimizer": engine.optimizer.state_dict(), "masters": masters, "layout": _layout(engine)}
        flat["pieces"] = _flat_pieces(engine, entries, tp)  # (read by the export to DeepSpeed, deepspeed_pipeline.py)
        files.append((_flat_file(engine), flat))
    if comm.get_rank() == 0:
        files.append(("engine_states.pt", _engine_state(engine, client_state)))
    if saves is not None and saves.plan.asynchronous:
        saves.begin(path, files, root / "latest" if save_latest else None)
        return True
    for name, obj in files:
        atomic_torch_save(obj, path / name)
    comm.barrier()
    if save_latest and comm.get_rank() == 0:
        atomic_write_text(root / "latest", tag)
    comm.barrier()
    return True


@dataclass
class _PendingPipelineSave:
    job: WriteJob
    latest: Path | None  # the `latest` file to point at the tag once committed (None: leave it)
    tag: str


class PipelineSaves(AsyncSaves):
    """Note [asynchronous pipeline saves]: with an asynchronous writer (`checkpoint.writer.decoupled`,
    `datastates_ckpt`, `casync_ckpt`) a pipeline save copies this rank's files into host memory and a
    background thread (checkpoint/async_writer.py) writes each one atomically into the tag directory; the save
    commits — every rank's files reported written, then `latest` — at the end of the next `train_batch`, or at
    the next save, load, `wait_for_checkpoint()` or `destroy()` (points every rank reaches in the same order:
    Note [no collectives off the training thread]). One save in flight at a time (AsyncSaves' `poll` and
    `flush`); a failed write raises at the commit on every rank and leaves `latest` as it was."""

    def begin(self, path: Path, files: list[tuple[str, object]], latest: Path | None) -> None:
        copies, nbytes = host_snapshot([obj for _, obj in files])
        job = WriteJob(path, list(zip([n for n, _ in files], copies)), io_buffer_bytes=self.plan.io_buffer_bytes)
        job.snapshot_bytes = nbytes
        super().begin(_PendingPipelineSave(job, latest, path.name))

    def commit(self, pending: _PendingPipelineSave) -> None:
        """Collective: every rank's files written, then `latest`."""
        job, tag = pending.job, pending.tag
        errors = [e for e in comm.all_gather_object(job.error) if e]
        if errors:
            raise CheckpointError(f"pipeline checkpoint {tag} was not saved: {'; '.join(sorted(set(errors)))}")
        if pending.latest is not None and comm.get_rank() == 0:
            atomic_write_text(pending.latest, tag)
        comm.barrier()
        if self.plan.show_statistics:
            logger.info("pipeline checkpoint %s: %d bytes in %.3f s", tag, job.nbytes, job.seconds)


def layers_written(indices: list[int], dp_rank: int, dp_size: int, parallel: bool) -> list[int]:
    """The stage's layer files data-parallel rank `dp_rank` writes: all of them on rank 0, or with
    `checkpoint.parallel_write.pipeline_stage` a consecutive run of them on every rank (the first
    len % dp_size runs one longer: DeepSpeed's split, which gives 9 layers over 2 ranks as 5 + 4)."""
    if not parallel:
        return indices if dp_rank == 0 else []
    base, extra = divmod(len(indices), dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return indices[start : start + base + (1 if dp_rank < extra else 0)]


def _flat_file(engine) -> str:
    """A rank's ZeRO-1/2 optimizer file (DeepSpeed's names; `mp_rank` only under tensor parallelism)."""
    m = engine.module
    mp = f"_mp_rank_{m.groups.rank_in('tp'):02d}" if m.grid.tp > 1 else ""
    return f"zero_pp_rank_{m.stage_id}_dp_rank_{comm.get_rank(engine.dp_group)}{mp}_optim_states.pt"


def _flat_pieces(engine, entries, tp: _TensorParallel) -> list[list[dict]]:
    """Per flat master, where its elements belong: the parameter's layers and names (`where`: [(layer index,
    name in the layer)], several for a tied module), its (local) shape and the piece's offsets (Piece); under tp
    also how the full tensor splits (`tp_layout`, None for a replicated parameter: Note [pipeline export with tp]
    in checkpoint/deepspeed_pipeline_tp.py joins the tp ranks' files by it)."""
    where, by_name = _param_layers(engine), dict(engine.module.named_parameters())
    out = []
    for e in entries:
        pieces = []
        for p in e.pieces:
            param = by_name[p.name]
            piece = {
                "where": where.get(id(param), []),
                "shape": tuple(param.shape),
                "param_offset": p.param_offset,
                "offset": p.offset,
                "numel": p.numel,
            }
            if tp.size > 1:
                piece["tp_layout"] = tp.layout_json(param)
            pieces.append(piece)
        out.append(pieces)
    return out


def _save_layer_optim(engine, files: list, tp: _TensorParallel, writes: bool) -> None:
    where = _param_layers(engine)
    per_layer: dict[int, dict] = {}
    for master, param in _masters(engine):
        state = {
            k: (
                tp.full(v, param)
                if isinstance(v, torch.Tensor) and v.shape == master.shape
                else (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
            )
            for k, v in engine.optimizer.state.get(master, {}).items()
        }
        full_master = tp.full(master, param)
        for idx, name in where.get(id(param), []):
            per_layer.setdefault(idx, {})[name] = {"master": full_master, "state": state}
            if tp.size > 1:  # (how the full tensors split: read by the export to DeepSpeed, deepspeed_pipeline_tp.py)
                per_layer[idx][name]["tp_layout"] = tp.layout_json(param)
    if writes:
        for idx, entries in per_layer.items():
            files.append((layer_file(idx, "optim"), entries))


def _engine_state(engine, client_state) -> dict:
    opt = engine.optimizer
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt else None,
        "client_state": client_state or {},
        "layout": _layout(engine),
        "tied_layers": engine.module.tied_layers(),  # (the export to DeepSpeed names tied modules by key)
        "ds_config": engine.config.model_dump(mode="json"),
    }


def load_pipeline_checkpoint(
    engine,
    load_dir,
    tag=None,
    strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    universal: bool = False,
):
    """Restore module states (any stage count); optimizer states as the module docstring says. `universal`
    (checkpoint.load_universal): without `tag`, the tag `latest_universal` names (a DeepSpeed universal folder,
    Note [DeepSpeed pipeline universal folders] in checkpoint/deepspeed_pipeline.py).

    Returns (path, client_state), or (None, None) when there is no checkpoint to load.
    """
    load_dir = check_load_dir(load_dir)
    if tag is None:
        latest = load_dir / ("latest_universal" if universal else "latest")
        if not latest.exists():
            logger.warning("no '%s' file in %s: nothing loaded", latest.name, load_dir)
            return None, None
        tag = latest.read_text().strip()
    path = load_dir / str(tag)
    if is_deepspeed_pipeline_tag(path) or is_deepspeed_pipeline_universal(path):
        return _load_deepspeed(engine, path, strict, load_optimizer_states, load_lr_scheduler_states)
    saved = torch.load(path / "engine_states.pt", map_location="cpu", weights_only=False)
    _load_modules(engine, path, strict)
    if load_optimizer_states and engine.optimizer is not None:
        _load_optimizer(engine, path, saved)
    else:
        engine.zero.load_masters_from_params()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if engine.loss_scaler is not None and saved["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        setattr(engine, key, saved[key])
    comm.barrier()
    return str(path), saved["client_state"]


def _load_deepspeed(engine, path: Path, strict: bool, with_optimizer: bool, with_scheduler: bool):
    """A tag DeepSpeed's PipelineEngine saved (Note [DeepSpeed pipeline checkpoints] in
    checkpoint/deepspeed_pipeline.py), ZeRO 0 or 1, or its universal folder (no layer files: the weights are
    its fp32 tensors): its layer files are this layout's; masters and optimizer states come per parameter, so
    they load at any stage count and data-parallel size, into ZeRO 0, 1 or 2."""
    module = engine.module
    if is_deepspeed_pipeline_universal(path):
        tp_folder = universal_tp_degree(path) > 1  # Note [DeepSpeed pipeline checkpoints with tp]
        ds = read_deepspeed_pipeline_universal_tp(path) if tp_folder else read_deepspeed_pipeline_universal(path)
        cut = _deepspeed_tp_cut(engine, ds)
        _load_universal_modules(engine, path, ds.universal, strict, cut)
    elif is_deepspeed_pipeline_tp_tag(path):  # Note [DeepSpeed pipeline checkpoints with tp]
        ds = read_deepspeed_pipeline_tp(path, module.tied_layers(), module.partition_bounds)
        cut = _deepspeed_tp_cut(engine, ds)
        _load_full_layers(engine, ds, strict, cut)
    else:
        ds = read_deepspeed_pipeline(path, module.tied_layers(), module.partition_bounds)
        cut = None  # (no universal_checkpoint_info: `_deepspeed_tp_cut` gives None)
        _load_modules(engine, path, strict)
    if with_optimizer and engine.optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        params = dict(module.named_parameters())
        uni = UniversalState()
        for name in names.values():
            theirs = _deepspeed_name(name)
            if theirs not in ds.universal.tensors:
                raise CheckpointError(
                    f"{path}: the DeepSpeed pipeline checkpoint has no optimizer state for {theirs} (this "
                    f"model's parameter {name}); pass load_optimizer_states=False to load the weights"
                )
            uni.tensors[name], uni.scalars[name] = ds.universal.tensors[theirs], ds.universal.scalars[theirs]
            if cut is not None:  # (full tensors: this rank's tp piece of each)
                where = f"{path} [{theirs}]"
                uni.tensors[name] = {
                    k: cut(theirs, v, params[name], where).reshape(-1) for k, v in uni.tensors[name].items()
                }
            uni.groups[name] = 0
        for group in engine.optimizer.param_groups:
            group.update(ds.param_groups[0])
        with engine.zero.resident(engine.optimizer):
            fill_from_universal(engine.zero.shard_entries(names), uni, engine.optimizer, True)
        engine.zero.sync_params_from_masters()
    else:
        engine.zero.load_masters_from_params()
    if with_scheduler and engine.lr_scheduler is not None and ds.meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(ds.meta["lr_scheduler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):  # (DeepSpeed saves no micro-step count)
        setattr(engine, key, int(ds.meta[key] or 0))
    comm.barrier()
    logger.info("loaded DeepSpeed %s pipeline checkpoint %s (ZeRO %d)", ds.meta.get("ds_version"), path, ds.zero_stage)
    return str(path), ds.client_state


def _deepspeed_tp_cut(engine, ds):
    """Note [DeepSpeed pipeline checkpoints with tp] (checkpoint/deepspeed_pipeline_tp.py): for a tag (or universal
    folder) read into full tensors, (DeepSpeed's name, full or flat tensor, parameter, where) -> this rank's piece:
    zerospeed's tensor-parallel layers by their shard layouts, plain layers (local tensors of a Megatron-style tp
    run) by the tag's name categories; None for other tags."""
    info = ds.meta.get("universal_checkpoint_info") if "tp" in ds.meta else None
    if info is None:
        return None
    tp, shapes = _TensorParallel(engine), ds.meta["shapes"]

    def cut(theirs: str, full: torch.Tensor, param: torch.Tensor, where) -> torch.Tensor:
        full = full.view(shapes[theirs])
        if id(param) not in tp.specs:
            full = tp_piece(info, theirs, full, tp.size, tp.rank, ds.tag_dir)
        return tp.piece(full, param, where)

    return cut


def _deepspeed_name(name: str) -> str:
    """DeepSpeed's stage-module name of this engine's parameter `name` (tied modules keep theirs)."""
    return name if name.startswith(TIED) else name.removeprefix("layer_modules.")


def _load_full_layers(engine, ds, strict: bool, cut) -> None:
    """This rank's layers from the full layer states of a DeepSpeed tag with tp; `cut`: `_deepspeed_tp_cut`'s."""
    tied = engine.module.tied_layers()
    for idx in engine.module.local_layer_indices():
        mod = engine.module.layer_module(idx)
        if mod is None:
            continue
        holders = [i for i in ds.layers if i == idx or (idx in tied and tied.get(i) == tied[idx])]
        if not holders:
            raise FileNotFoundError(
                f"{ds.tag_dir}: layer {idx} of this model has no layer file (was the checkpoint written by a "
                "different layer list?)"
            )
        prefix, params = f"{TIED}{tied[idx]}." if idx in tied else f"{idx}.", dict(mod.named_parameters())
        state = {
            k: cut(prefix + k, v, params[k], f"{ds.tag_dir} [{prefix}{k}]") if k in params else v
            for k, v in ds.layers[holders[0]].items()
        }
        mod.load_state_dict({k: v.to(engine.device) for k, v in state.items()}, strict=strict)


def _load_universal_modules(engine, path: Path, uni: UniversalState, strict: bool, cut=None) -> None:
    """This rank's parameters from a pipeline universal folder's fp32 tensors (buffers keep their values, as in
    DeepSpeed's PipelineEngine); `cut`: this rank's tp piece of each (`_deepspeed_tp_cut`)."""
    missing = []
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            theirs = _deepspeed_name(name)
            if theirs not in uni.tensors:
                missing.append(theirs)
                continue
            full = uni.tensors[theirs][FP32]
            if cut is not None:
                full = cut(theirs, full, p, f"{path / 'zero' / theirs}")
            if full.numel() != p.numel():
                raise CheckpointError(
                    f"{path / 'zero' / theirs}: {full.numel()} elements, this model's {name} has shape "
                    f"{tuple(p.shape)} (a different model, or a tensor-parallel one?)"
                )
            p.copy_(full.view(p.shape).to(p.dtype))
    if missing and strict:
        raise CheckpointError(
            f"{path}: the universal folder has no zero/<name>/fp32.pt for {missing[:4]} (is it a checkpoint of this "
            "model: same layers and tie keys?); pass load_module_strict=False to keep those parameters"
        )


def _load_modules(engine, path: Path, strict: bool) -> None:
    device, tp, tied = engine.device, _TensorParallel(engine), engine.module.tied_layers()
    for idx in engine.module.local_layer_indices():
        mod = engine.module.layer_module(idx)
        if mod is None:
            continue
        file = path / layer_file(idx)
        key = tied.get(idx)
        if not file.exists() and key is not None:  # DeepSpeed writes no file for a tied layer with a forward_fn
            holders = [i for i, k in tied.items() if k == key and (path / layer_file(i)).exists()]
            file = path / layer_file(holders[0]) if holders else file
        if not file.exists():
            raise FileNotFoundError(
                f"{file}: layer {idx} of this model has no saved state (was the checkpoint "
                "written by a different layer list?)"
            )
        state = tp.load_module(mod, torch.load(file, map_location="cpu", weights_only=True), file)
        mod.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=strict)


def _load_optimizer(engine, path: Path, saved: dict) -> None:
    here = _layout(engine)
    if saved["param_groups"] is not None and len(saved["param_groups"]) == len(engine.optimizer.param_groups):
        for group, hparams in zip(engine.optimizer.param_groups, saved["param_groups"]):
            group.update(hparams)
    if here["zero_stage"] == 0:
        if saved["layout"]["zero_stage"] != 0:
            raise ConfigError(
                f"{path}: optimizer states were saved with ZeRO stage {saved['layout']['zero_stage']} "
                "and load only into that stage and layout; pass load_optimizer_states=False"
            )
        _load_layer_optim(engine, path)
        return
    if {k: saved["layout"].get(k, 1 if k == "tp" else None) for k in here} != here:
        raise ConfigError(
            f"{path}: ZeRO-1 optimizer states were saved by layout {saved['layout']} and this job is "
            f"{here}; they load only into the same layout. Pass load_optimizer_states=False to load "
            "the module states alone, or save with ZeRO stage 0 to reshard optimizer states"
        )
    file = path / _flat_file(engine)
    state = torch.load(file, map_location=engine.device, weights_only=False)
    engine.optimizer.load_state_dict(state["optimizer"])
    names = {id(p): n for n, p in engine.module.named_parameters()}
    with torch.no_grad():
        for entry, master in zip(engine.zero.shard_entries(names), state["masters"]):
            entry.master.copy_(master)
    engine.zero.sync_params_from_masters()


def _load_layer_optim(engine, path: Path, cache: dict[int, dict] | None = None) -> None:
    """`cache`: each layer's {name: {"master", "state"}} already read (else the layer optim files)."""
    where = _param_layers(engine)
    tp = _TensorParallel(engine)
    cache = {} if cache is None else cache
    with torch.no_grad():
        for master, param in _masters(engine):
            idx, name = where[id(param)][0]
            file = path / layer_file(idx, "optim")
            if idx not in cache:
                cache[idx] = torch.load(file, map_location="cpu", weights_only=False)
            entry = cache[idx][name]
            full = entry["master"]
            master.copy_(tp.piece(full, param, f"{file} [{name}]"))
            engine.optimizer.state[master] = {
                k: (
                    tp.piece(v, param, f"{file} [{name}.{k}]").to(engine.device)
                    if isinstance(v, torch.Tensor) and v.shape == full.shape and v.dim() > 0
                    else v.to(engine.device)
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                    else v
                )
                for k, v in entry["state"].items()
            }
    engine.zero.sync_params_from_masters()
