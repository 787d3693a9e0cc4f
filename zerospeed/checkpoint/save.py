"""Saving: every rank writes its own shard file, rank 0 the model states and the manifest, `latest` last.

Order of a save (each step finishes on every rank before the next begins):
  1. rank 0 empties the staging directory `.{tag}.partial`;
  2. data-parallel rank 0 of each tensor-parallel rank t writes mp_rank_{t:02d}_model_states.pt, every
     rank its zero_pp_rank_{d}_mp_rank_{t:02d}_... file (each through a temporary name, fsync and
     rename) and hashes it — in the call, or for an asynchronous save (checkpoint/async_writer.py) on a
     background thread from a host snapshot taken in the call;
  3. the commit (`commit_save`, in the call or at the next sync point of an asynchronous save): every
     rank reports its files and any failure; rank 0 writes the manifest and renames the staging directory
     to `{tag}` (Note [tag directory swap] in atomic.py);
  4. rank 0 rewrites `latest`, then a barrier.
A process killed at any point leaves `latest` naming a complete checkpoint; a failed write (a full disk)
raises on every rank and leaves the previous checkpoint and `latest` as they were. With node-local storage
(`checkpoint.use_node_local_storage`) local rank 0 of every node does rank 0's part in its own directory.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.checkpoint.async_writer import (
    BackgroundWriter,
    SnapshotPool,
    WriteJob,
    WriterPlan,
    host_snapshot,
    payload_bytes,
)
from zerospeed.checkpoint.atomic import atomic_torch_save, fresh_dir, swap_in_dir
from zerospeed.checkpoint.deepspeed_layout import (
    as_saved_rank_states,
    as_saved_stage0,
    as_saved_stage12_rank_states,
    check_as_saved,
    ds_model_states_name,
)
from zerospeed.checkpoint.deepspeed_pickle import PICKLE_MODULE
from zerospeed.checkpoint.errors import CheckpointError, raise_if_any_rank_failed
from zerospeed.checkpoint.experts import CheckpointNames, expert_spans, is_expert_key, write_expert_files
from zerospeed.checkpoint.layout import EntryLayout, RankFile, entry_groups, split_state
from zerospeed.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    PLAIN_FORMAT_VERSION,
    dtype_name,
    tied_aliases,
    write_manifest,
)
from zerospeed.checkpoint.naming import (
    UNIVERSAL_INFO,
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
from zerospeed.checkpoint.replicated import check_engine_replicated
from zerospeed.checkpoint.rng import capture_rng_state
from zerospeed.checkpoint.state import RESERVED_KEYS, TrainingState, training_state_dict
from zerospeed.checkpoint.tags import agree_on_tag
from zerospeed.checkpoint.tensor_parallel import layouts_to_json, pack_pieces
from zerospeed.utils.files import atomic_write_text
from zerospeed.version import __version__
from zerospeed.zero import GatheredParameters
from zerospeed.zero.tags import full_shape

logger = logging.getLogger(__name__)

# RESERVED_KEYS (the model-states keys that are not client state) lives in checkpoint/state.py: deepspeed_export,
# which this module's as-saved DeepSpeed layout uses, reads it too.


def compact(t: torch.Tensor, views_ok: bool = False) -> torch.Tensor:
    """`t` detached, cloned only when it views a larger storage (torch.save writes whole storages:
    a parameter that is a view into a flat ZeRO bucket would otherwise drag the bucket along).
    `views_ok`: never cloned (an asynchronous save's host snapshot copies it compactly anyway)."""
    t = t.detach()
    if views_ok or t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone()


def compact_tree(obj):
    """`obj` (nested dicts, lists, tuples) with every tensor through `compact`, tensors that were one tensor
    staying one."""
    seen: dict[tuple, torch.Tensor] = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape), tuple(o.stride()), o.dtype)
            if key not in seen:
                seen[key] = compact(o)
            return seen[key]
        if isinstance(o, dict):
            return type(o)((k, walk(v)) for k, v in o.items())
        if isinstance(o, (list, tuple)) and type(o) in (list, tuple):
            return type(o)(walk(v) for v in o)
        return o

    return walk(obj)


def compact_state_dict(sd: dict, views_ok: bool = False) -> dict:
    """`compact` applied to every tensor; tensors that were the same stay one tensor (tied weights)."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
            if key not in seen:
                seen[key] = compact(v, views_ok)
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
    views_ok: bool = False,
) -> dict:
    """`frozen`: id(parameter) -> full value of stage 3's partitioned frozen parameters, which the model
    states hold whole (`state.zero.frozen_values`, gathered by every rank beforehand). `views_ok`: as in
    `compact`."""
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
        "module": compact_state_dict(sd, views_ok),
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
    states.setdefault("universal_checkpoint_info", dict(UNIVERSAL_INFO))  # a client's own (Megatron's) wins
    return states


def _rank_states(
    state: TrainingState, place: Placement, names: CheckpointNames, replicated_once: bool = True, views_ok: bool = False
) -> tuple[dict, list[EntryLayout]]:
    """This rank's shard (its entries; when every rank holds the same state, only data-parallel rank 0's —
    and, with MoE layers, each expert's from rank 0 of its expert-data-parallel group; under tensor
    parallelism only the pieces this tp rank writes) and RNG. `replicated_once=False` (node-local storage:
    a node's copy must load without the other nodes' files): every rank writes the entries it holds."""
    entries = names.global_entries(state.zero.shard_entries(names.params))
    opt = state.optimizer
    groups = entry_groups(opt, [e.master for e in entries])
    if state.zero.replicated_state and replicated_once:
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
                "master": compact(master, views_ok),
                "state": {
                    **{
                        k: compact(pack_pieces(saved[k].reshape(-1), entry.pieces, keep)[0], views_ok)
                        for k in elementwise
                    },
                    **{k: saved[k] for k in scalars},
                },
            }
        )
        layouts.append(EntryLayout(group, master.numel(), tuple(pieces), tuple(elementwise), tuple(scalars)))
    return {**_rank_header(state, place), "entries": records}, layouts


def _rank_header(state: TrainingState, place: Placement) -> dict:
    """A rank file's keys besides its entries."""
    return {
        "rank": place.dp_rank,
        "tp_rank": place.tp_rank,
        "dp_world_size": zero_dp_size(state),
        "zero_stage": state.zero.stage,
        "rng": capture_rng_state(),
        "ds_version": __version__,
    }


def _as_saved(
    state: TrainingState, place: Placement, names: CheckpointNames, client_state: dict, job: WriteJob
) -> tuple[dict, list[EntryLayout]]:
    """Collective (Note [as-saved DeepSpeed layout]): this rank's shard and layouts in DeepSpeed's ZeRO-3 layout,
    with DeepSpeed's model states added to `job` beside it, and DeepSpeed's form of `param_shapes` in the model
    states `job` holds (DeepSpeed's zero_to_fp32 reads every *_model_states.pt of the tag). ZeRO 1/2: DeepSpeed's
    slices instead (Note [as-saved ZeRO 1/2]), whose model states are zerospeed's own file (DeepSpeed's form of
    `param_shapes` in it). ZeRO 0: the optimizer state and zerospeed's entries go into the model states
    (Note [as-saved ZeRO 0]); the rank files keep the header (RNG) only."""
    # this rank's model states in `job` (None on ranks that write none)
    model = next((obj for name, obj in job.items if name == model_states_name(place.tp_rank)), None)
    header = _rank_header(state, place)
    if state.zero.stage == 0:
        layouts = as_saved_stage0(state, names, model)
        return {**header, "entries": []}, layouts if place.dp_rank == 0 else []
    if state.zero.stage < 3:
        shard, layouts, shapes = as_saved_stage12_rank_states(state, names, place.dp_rank, header, client_state)
    else:
        shard, layouts, ds_states = as_saved_rank_states(state, names, place.dp_rank, header, client_state)
        shapes = ds_states["param_shapes"]
        job.items.append((ds_model_states_name(place.dp_rank), ds_states))
    if model is not None:
        model["param_shapes"] = shapes
    job.pickle_modules[optim_states_name(place.dp_rank, place.tp_rank)] = PICKLE_MODULE
    return shard, layouts


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
    saves: AsyncSaves | None = None,
) -> bool:
    """Collective: save the full training state under `save_dir/tag` (default global_step{N}).

    Every rank must call it. The checkpoint loads at any world size, tensor-parallel degree and ZeRO
    stage (see `load_checkpoint`); `client_state` (a dict) comes back from the load. `state`: the
    engine's `TrainingState`. `saves`: the engine's `AsyncSaves`; with an asynchronous plan the call
    returns once the state is snapshotted and the checkpoint commits later (checkpoint/async_writer.py);
    a save still in flight is committed first (Note [one save in flight]).
    """
    if saves is not None:
        saves.flush()
    root = check_save_dir(save_dir)
    check_supported(state, experts_ok=True)
    place = placement(state)
    names = checkpoint_names(state, place)  # collective with MoE layers (Note [global expert names])
    check_engine_replicated(state, names, place)  # Note [hand-split parameters] (collective over tp)
    client_state = dict(client_state or {})
    if saves is not None and saves.plan.deepspeed_layout:
        check_as_saved(state, names)
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
    plan = saves.plan if saves is not None else WriterPlan()
    start = time.perf_counter()
    error = None
    if _writes_tag_files(plan):
        try:
            paths.root.mkdir(parents=True, exist_ok=True)
            fresh_dir(paths.staging)
        except OSError as exc:
            error = f"cannot create {paths.staging}: {exc}"
    raise_if_any_rank_failed(error)

    writes_model = _writes_model_states(plan, place)
    # stage 3's partitioned frozen parameters, whole in the model states (collective)
    frozen = state.zero.frozen_values(keep=writes_model) if not exclude_frozen_parameters else {}
    views_ok = plan.asynchronous  # the snapshot copies compactly: no clone of views before it
    job = WriteJob(paths.staging, [], io_buffer_bytes=plan.io_buffer_bytes)
    layouts = []
    with state.zero.resident(state.optimizer):  # NVMe-offloaded state: in memory while it is copied or written
        failure = None  # every rank learns of it at the commit, or the others would hang
        try:
            if writes_model:
                model_states = _model_states(
                    state, client_state, exclude_frozen_parameters, names.spans, place, frozen, views_ok=views_ok
                )
                job.items.append((model_states_name(place.tp_rank), model_states))
                del model_states
        except Exception as exc:  # noqa: BLE001 — as above
            failure = exc
        try:  # (after a failure above too: _as_saved is collective, every rank must join it)
            if plan.deepspeed_layout:
                shard, layouts = _as_saved(state, place, names, client_state, job)
            else:
                shard, layouts = _rank_states(
                    state, place, names, replicated_once=not plan.node_local, views_ok=views_ok
                )
            job.items.append((optim_states_name(place.dp_rank, place.tp_rank), shard))
            del shard
        except Exception as exc:  # noqa: BLE001 — as above
            failure = failure or exc
        if failure is not None:
            job.items, job.error = [], f"rank {comm.get_rank()} could not gather its checkpoint state: {failure!r}"
        asynchronous = plan.asynchronous and _fits_host_cache(plan, job.items)  # (collective with a host cache)
        if views_ok and not asynchronous:
            job.items = [(name, compact_tree(obj)) for name, obj in job.items]
        if asynchronous and job.error is None:
            try:
                objs, job.snapshot_bytes = host_snapshot([obj for _, obj in job.items], *_pinning(), pool=saves.pool)
                job.items = [(name, obj) for (name, _), obj in zip(job.items, objs)]
            except Exception as exc:  # noqa: BLE001 — as above
                job.items, job.error = [], f"rank {comm.get_rank()} could not copy its checkpoint state: {exc!r}"
        elif not asynchronous:
            job.run()
    expert_files, expert_error = write_expert_files(state.module, names.spans, paths.staging)  # collective at stage 3
    base = None
    if _writes_tag_files(plan):
        excluded = _frozen_names(state.module) if exclude_frozen_parameters else []
        base = _manifest(state, tag, {}, [], excluded, names, place)  # files and partition filled in at the commit
        base["replicated"] = base["replicated"] and not plan.node_local  # (every rank wrote what it holds)
    pending = PendingSave(
        paths,
        tag,
        save_latest,
        plan,
        job,
        expert_files,
        expert_error,
        layouts,
        place.dp_rank,
        place.tp_rank,
        base,
        start,
    )
    if plan.deepspeed_layout and state.zero.stage == 0 and layouts:
        pending.entries_file = model_states_name(place.tp_rank)  # (Note [as-saved ZeRO 0])
    if asynchronous:
        pending.snapshot_seconds = time.perf_counter() - start
        saves.begin(pending)
    else:
        commit_save(pending)
    return True


def _fits_host_cache(plan: WriterPlan, items) -> bool:
    """Whether this rank's snapshot fits `datastates_ckpt.host_cache_size`. Every rank must decide alike (the
    commit is collective either way, but a synchronous save on one rank would stall the others at it), so
    the largest rank's size decides."""
    if plan.host_cache_bytes is None:
        return True
    need = max(comm.all_gather_object(sum(payload_bytes(obj) for _, obj in items)))
    if need <= plan.host_cache_bytes:
        return True
    logger.warning(
        "checkpoint snapshot of %d bytes exceeds datastates_ckpt.host_cache_size (%d bytes): saving synchronously",
        need,
        plan.host_cache_bytes,
    )
    return False


def _pinning():
    """(pinned allocator, synchronize) of the accelerator the training state lives on."""
    accel = get_accelerator()
    if accel.name == "cpu":
        return None, None
    return accel.pinned_empty, accel.synchronize


def _writes_model_states(plan: WriterPlan, place: Placement) -> bool:
    """Whether this rank writes its tensor-parallel rank's model states: data-parallel rank 0; with node-local
    storage also the first rank of every other node holding that tp rank (each node's copy must load on its
    own). Nodes are told apart as launchers number ranks: a node's ranks are consecutive, so a rank's node
    starts at global rank - local rank. Collective with node-local storage."""
    if not plan.node_local:
        return place.dp_rank == 0
    me = (comm.get_rank() - comm.get_local_rank(), place.tp_rank, place.dp_rank)
    firsts: dict[tuple, int] = {}
    for node, tp, dp in comm.all_gather_object(me):
        firsts[(node, tp)] = min(dp, firsts.get((node, tp), dp))
    return place.dp_rank == 0 or firsts[me[:2]] == place.dp_rank


def _writes_tag_files(plan: WriterPlan) -> bool:
    """Whether this rank creates the staging directory and writes the manifest and `latest`: global rank 0,
    or with node-local storage (`checkpoint.use_node_local_storage`) local rank 0 of every node."""
    return (comm.get_local_rank() if plan.node_local else comm.get_rank()) == 0


@dataclass
class PendingSave:
    """A save whose rank files are written (or being written); `commit_save` makes it a checkpoint."""

    paths: CheckpointPaths
    tag: str
    save_latest: bool
    plan: WriterPlan
    job: WriteJob
    expert_files: dict
    expert_error: str | None
    layouts: list[EntryLayout]
    dp_rank: int
    tp_rank: int
    manifest: dict | None  # on the ranks that write the manifest
    start: float
    snapshot_seconds: float = 0.0
    entries_file: str | None = None  # where this rank's entries are, when not its rank file (Note [as-saved ZeRO 0])


def commit_save(pending: PendingSave) -> None:  # noqa: C901
    """Collective: once every rank's files are written (and fsync'ed), write the manifest, rename the staging
    directory to the tag and move `latest` (save.py's module docstring has the order). A failure on any
    rank raises the same CheckpointError on every rank and leaves the previous checkpoint and `latest` as
    they were; the staging directory is removed to give its space back."""
    job, plan = pending.job, pending.plan
    error = job.error or pending.expert_error
    node = comm.get_rank() - comm.get_local_rank()  # (as in _writes_model_states)
    gathered = comm.all_gather_object(
        (
            error,
            node,
            {**job.records, **pending.expert_files},
            [e.to_json() for e in pending.layouts],
            pending.dp_rank,
            pending.tp_rank,
            pending.entries_file,
        )
    )
    tag_writer = _writes_tag_files(plan)
    errors = [(r, g[0]) for r, g in enumerate(gathered) if g[0]]
    if errors:
        if tag_writer:
            shutil.rmtree(pending.paths.staging, ignore_errors=True)
        comm.barrier()  # the error surfaces on every rank with the staging directory gone
        messages = {e for _, e in errors}
        raise CheckpointError(errors[0][1] if len(messages) == 1 else "; ".join(f"rank {r}: {e}" for r, e in errors))
    error = None
    if tag_writer:
        try:
            manifest = pending.manifest
            # with node-local storage a file several nodes wrote is listed as this node wrote it
            ordered = sorted(gathered, key=lambda g: g[1] == node)
            manifest["files"] = {k: v for _, _, files, *_ in ordered for k, v in files.items()}
            manifest["partition"] = [
                rf.to_json()
                for rf in sorted(
                    (
                        RankFile.from_json(
                            {"rank": d, "tp_rank": t, "file": f or optim_states_name(d, t), "entries": lay}
                        )
                        for *_, lay, d, t, f in gathered
                    ),
                    key=lambda rf: (rf.tp_rank, rf.rank),
                )
            ]
            write_manifest(pending.paths.staging, manifest)
            swap_in_dir(pending.paths.staging, pending.paths.dir, pending.paths.previous)
        except OSError as exc:
            error = f"could not finish checkpoint {pending.paths.dir}: {exc}"
    raise_if_any_rank_failed(error)
    if pending.save_latest and tag_writer:
        atomic_write_text(pending.paths.latest, pending.tag)
    comm.barrier()
    elapsed = time.perf_counter() - pending.start
    logger.info("saved checkpoint %s (%d rank files) in %.2fs", pending.paths.dir, len(gathered), elapsed)
    if plan.show_statistics:
        total = sum(r["bytes"] for _, _, files, *_ in gathered for r in files.values())
        logger.info(
            "checkpoint %s: %d bytes on this rank written in %.3fs (%.2f GB/s); training blocked %.3fs "
            "(snapshot of %d bytes); %d bytes in all, committed %.3fs after the save began",
            pending.tag,
            job.nbytes,
            job.seconds,
            job.nbytes / max(job.seconds, 1e-9) / 1e9,
            pending.snapshot_seconds,
            job.snapshot_bytes,
            total,
            elapsed,
        )


class AsyncSaves:
    """An engine's checkpoint saves under its `WriterPlan`: at most one in flight (Note [one save in flight]),
    committed at the training loop's sync points (Note [no collectives off the training thread])."""

    def __init__(self, plan: WriterPlan):
        self.plan = plan
        self.writer = BackgroundWriter()
        self.pending: PendingSave | None = None
        self.pool = SnapshotPool()  # the host buffers of the last snapshot, reused by the next

    def begin(self, pending: PendingSave) -> None:
        self.pending = pending
        self.writer.start(pending.job)

    def in_flight(self) -> bool:
        return self.pending is not None

    def poll(self) -> bool:
        """Collective: commit the save in flight if every rank's writer is done (never waits for one);
        True when nothing is left in flight."""
        if self.pending is None:
            return True
        if not all(comm.all_gather_object(self.writer.done())):
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Collective: wait for the save in flight (if any) and commit it; its failure raises here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        self.writer.join()
        self.pool.release()  # written: its buffers may take the next snapshot
        self.commit(pending)

    def commit(self, pending: PendingSave) -> None:
        """Collective: make the written save a checkpoint (a pipeline engine's saves commit their own way)."""
        commit_save(pending)


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
