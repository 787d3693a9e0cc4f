"""ZeRO-3 rank files in DeepSpeed 0.19.8's own layout, so that DeepSpeed's `engine.load_checkpoint` reads a
zerospeed tag as saved (`checkpoint.deepspeed_layout: true`, a zerospeed key).

Note [as-saved DeepSpeed layout]: zerospeed's stage 3 shards a unit's flat concatenation (padded to a multiple
of 4 x dp) into dp chunks, so a rank's chunk holds other elements than DeepSpeed's rank, which cuts every
parameter alone into ceil(numel / dp) pieces (Note [DeepSpeed's partitions] in deepspeed_export.py). The pieces
cannot be views of zerospeed's masters, so with this key the save moves them: one all-gather per unit of its
master and elementwise optimizer state, from which each rank keeps DeepSpeed's pieces of that unit's
parameters. Each rank then writes DeepSpeed's `optimizer_state_dict` (`fp32_flat_groups` per sub-group of
`sub_group_size`, the torch optimizer's state per sub-group, the loss scaler) and, as zerospeed's entries, the
same tensors: one entry per sub-group, whose pieces (ceil(numel / dp) elements from r x ceil(numel / dp) of
each parameter) the manifest records. torch.save writes a storage once, so the rank file holds each value
once; zerospeed's loader reads these entries like any other layout (resharded). Beside it each rank writes
DeepSpeed's small `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (buffers, placeholders, counters, config; what
DeepSpeed's ZeRO-3 loader opens per rank). The cost is that all-gather and the pieces' memory at save time,
which is why the key is off by default. ZeRO 0: Note [as-saved ZeRO 0].

Note [as-saved ZeRO 1/2]: zerospeed's ZeRO 1/2 cut each bucket into dp chunks (padded to 4 x dp), DeepSpeed cuts
each param group's flat concatenation (padded to 2 x dp) into dp contiguous slices (Note [DeepSpeed's partitions]
in deepspeed_export.py), so here too the save moves the values: one all-gather per flat entry and key gives every
rank the full masters and elementwise state, from which deepspeed_export's `_stage12_optim` cuts this rank's
DeepSpeed `optimizer_state_dict` (`single_partition_of_fp32_groups` without the padding, the torch optimizer's
state over the padded slice, paddings, `param_slice_mappings`, ...). zerospeed's entries are the same tensors:
one entry per param group, the fp32 slice as master and views of the first `numel` elements of the state (so
torch.save writes each storage once). The model states are zerospeed's own `mp_rank_00_model_states.pt` (the
name DeepSpeed reads at ZeRO 1/2), with `param_shapes` in DeepSpeed's form. The price is the full state on every
rank for the length of the save (ZeRO 3 holds only a unit at a time). Each group's parameters are taken in
module order (DeepSpeed flattens them in the order the group lists them: the same when groups list parameters in
module order, as `model.parameters()` does).

Note [as-saved ZeRO 0]: DeepSpeed's ZeRO 0 (a plain torch optimizer) writes no optimizer file: its
`mp_rank_00_model_states.pt` holds the optimizer's `state_dict()` under `optimizer` (state keyed by each parameter's
position in the param groups' order, elementwise state in the parameter's shape; the groups' hyperparameters with
`params` as those positions), which its loader hands to `optimizer.load_state_dict`. zerospeed's ZeRO-0 masters
are the fp32 parameters themselves, held whole by every rank, so nothing is gathered or moved: the ranks that
write the model states put that `optimizer` into them and, as zerospeed's entries (`entries`, as a rank file has
them), the same tensors: each master is the module state's weight, each elementwise state the `optimizer`'s
tensor, so torch.save writes every value once. The manifest's partition names the model-states file as rank 0's
file, and zerospeed's loaders read the entries from there (same layout or resharded, as from any rank file;
entries keep the parameter's shape, which the loaders flatten). The rank files keep each rank's RNG state only.
`optimizer` and `entries` are therefore reserved model-states keys (RESERVED_KEYS in state.py). fp16 at ZeRO 0 is
refused: DeepSpeed keeps that state in its FP16_Optimizer, whose files its CPU accelerator cannot write (it refuses
fp16 on a CPU without mkldnn fp16), so the layout could not be checked against DeepSpeed.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import OrderedDict

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.checkpoint.deepspeed_export import (
    DEFAULT_SUB_GROUP_SIZE,
    ExportSource,
    _ds_config,
    _flat_range,
    _hyper,
    _model_states,
    _own,
    _stage12_optim,
    slice_mappings,
    stage3_optimizer_state,
    stage3_partition,
    sub_groups,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.experts import CheckpointNames
from zerospeed.checkpoint.layout import EntryLayout, entry_groups, split_state
from zerospeed.checkpoint.manifest import tied_aliases
from zerospeed.checkpoint.state import TrainingState, training_state_dict
from zerospeed.checkpoint.universal import FP32, UniversalState
from zerospeed.utils.errors import ConfigError
from zerospeed.zero.shards import Piece
from zerospeed.zero.tags import full_shape

KEY = "checkpoint.deepspeed_layout"
STAGES = (0, 1, 2, 3)  # the ZeRO stages saved this way


def ds_model_states_name(dp_rank: int) -> str:
    """DeepSpeed's per-rank ZeRO-3 model-states file."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"


def check_as_saved(state: TrainingState, names: CheckpointNames) -> None:
    """Raise (alike on every rank) where a save cannot be in DeepSpeed's layout as saved."""
    mesh, zero_cfg = state.mesh, (state.ds_config or {}).get("zero_optimization") or {}
    if state.zero.stage == 0 and state.param_dtype == torch.float16:
        raise ConfigError(
            f"{KEY}=true with fp16.enabled at zero_optimization.stage 0: DeepSpeed 0.19.8 keeps that state in its "
            "FP16_Optimizer, which it refuses to build on a CPU without fp16 support, so zerospeed does not write "
            "that layout (Note [as-saved ZeRO 0]); set checkpoint.deepspeed_layout false, or use ZeRO stage 1-3"
        )
    problem = None
    if state.zero.stage not in STAGES:
        problem = f"ZeRO stage {state.zero.stage} is not saved in DeepSpeed's layout; set it false"
    elif mesh.size("tp") > 1 or mesh.size("sp") > 1 or mesh.size("pp") > 1 or names.has_experts:
        problem = "tensor, sequence, pipeline or expert parallelism: only plain data parallelism is written this way"
    elif int(zero_cfg.get("mics_shard_size", -1) or -1) > 0:
        problem = "MiCS (zero_optimization.mics_shard_size) shards the state over sub-groups DeepSpeed lays out alike"
    elif state.param_dtype == torch.bfloat16:
        problem = (
            "bf16 weights: DeepSpeed's bf16 loader reads only bf16_zero_pp_rank_* files, not the rank files "
            "zerospeed reads; export the tag with `zerospeed-ckpt export --to deepspeed` instead"
        )
    elif state.optimizer is None:
        problem = "no optimizer: DeepSpeed's ZeRO-3 files hold the optimizer's state"
    elif any(not p.requires_grad for p in state.module.parameters()):
        problem = "frozen parameters (their partitions would be written twice); export the tag instead"
    elif 0 < state.zero.stage < 3 and any(zero_cfg.get(k) for k in ("round_robin_gradients", "parameter_alignment")):
        problem = (
            "zero_optimization.round_robin_gradients / parameter_alignment: DeepSpeed's ZeRO 1/2 flat layout "
            "then reorders or pads the parameters, which this save does not write; export the tag instead"
        )
    elif state.zero.stage < 3 and state.master_dtype != torch.float32:
        problem = "masters not in fp32: DeepSpeed's ZeRO 1/2 files hold fp32 partitions; export the tag instead"
    if problem is not None:
        raise CheckpointError(f"save_checkpoint with {KEY}: {problem}")


def _full_of_entries(entry, saved: dict, keys: list[str], everyone: list, k: int, sizes: dict[str, int]) -> dict:
    """Collective: name -> key -> the full flat tensor (`sizes[name]` elements) of every parameter with a piece
    in entry `k` on any rank, from one all-gather per key of every rank's entry `k` (equal sizes at stage 3)."""
    numel, dp, accelerator = entry.master.numel(), len(everyone), get_accelerator()
    if any(len(pieces) <= k or pieces[k][0] != numel for pieces in everyone):
        raise CheckpointError(f"save_checkpoint with {KEY}: the ranks' shards of unit {k} differ in size")
    full = {}
    for key in keys:
        local = (entry.master if key == FP32 else saved[key]).detach().reshape(-1).contiguous()
        if local.device.type == "cpu" and accelerator.name != "cpu":  # (an offloaded master: NCCL gathers on device)
            local = local.to(accelerator.current_device_name())
        gathered = torch.empty(dp * numel, dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(gathered, local)
        gathered = gathered.cpu()
        for q, (_, pieces) in enumerate(p[k] for p in everyone):
            for name, param_offset, offset, n in pieces:
                out = full.setdefault(name, {}).setdefault(key, torch.zeros(sizes[name], dtype=local.dtype))
                out[param_offset : param_offset + n].copy_(gathered[q * numel + offset : q * numel + offset + n])
    return full


def _full_entries(state: TrainingState, names: CheckpointNames):
    """Collective, one zerospeed flat entry at a time: (name, {key: full fp32 master / elementwise state},
    {key: scalar state}, param group) of each trainable parameter (one all-gather per entry and key)."""
    opt = state.optimizer
    entries = names.global_entries(state.zero.shard_entries(names.params))
    groups = entry_groups(opt, [e.master for e in entries])
    mine = [(e.master.numel(), [(p.name, p.param_offset, p.offset, p.numel) for p in e.pieces]) for e in entries]
    everyone = comm.all_gather_object(mine)
    sizes = {name: math.prod(spec["shape"]) for name, spec in names.specs.items()}
    for k, (entry, gi) in enumerate(zip(entries, groups)):
        saved = opt.state.get(entry.master, {})
        elementwise, scalar_keys = split_state(saved, entry.master.numel())
        for name, full in _full_of_entries(entry, saved, [FP32, *elementwise], everyone, k, sizes).items():
            yield name, full, {s: _own(saved[s]) for s in scalar_keys}, gi


def _deepspeed_pieces(state: TrainingState, names: CheckpointNames, dp: int, rank: int):
    """Collective: name -> key -> this rank's DeepSpeed piece; name -> scalar state; name -> param group (one
    entry's full tensors held at a time)."""
    pieces, scalars, group_of = {}, {}, {}
    for name, full, scalar, gi in _full_entries(state, names):
        part = stage3_partition(full[FP32].numel(), dp)  # (ceil(numel / dp); the last rank's piece zero-padded)
        pieces[name] = {key: _flat_range(t, rank * part, (rank + 1) * part) for key, t in full.items()}
        scalars[name], group_of[name] = scalar, gi
    return pieces, scalars, group_of


def _module_order_groups(state: TrainingState, names: CheckpointNames, group_of: dict[str, int]) -> list[list[str]]:
    """The trained parameters' names per optimizer param group (`group_of`: name -> group), in module order."""
    order = [names.params[id(p)] for p in state.module.parameters() if p.requires_grad]
    return [[n for n in order if group_of.get(n) == gi] for gi in range(len(state.optimizer.param_groups))]


def _source(state: TrainingState, names: CheckpointNames, group_names: list[list[str]]) -> ExportSource:
    """What deepspeed_export's writers read of a checkpoint, from the live state (shapes only: no values)."""
    module = state.module
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    buffers = {k: v.detach().cpu() for k, v in module.state_dict().items() if k not in param_names}
    meta = training_state_dict(state)
    meta["ds_config"] = state.ds_config or {}
    shapes = {n: torch.empty(full_shape(p), device="meta") for n, p in module.named_parameters() if p.requires_grad}
    return ExportSource(
        universal=UniversalState({names.params[id(p)]: {FP32: shapes[n]} for n, p in module.named_parameters()}),
        group_names=group_names,
        param_groups=meta["optimizer_param_groups"],
        module=buffers,
        module_keys=list(names.module_keys),
        buffer_names=list(buffers),
        tied=tied_aliases(module),
        param_dtype=state.param_dtype,
        meta=meta,
    )


def as_saved_rank_states(
    state: TrainingState, names: CheckpointNames, dp_rank: int, header: dict, client_state: dict
) -> tuple[dict, list[EntryLayout], dict]:
    """Collective: (this rank's file: `header` + zerospeed's entries + DeepSpeed's `optimizer_state_dict` over the
    same tensors, the entries' layouts, DeepSpeed's model states of this rank) (Note [as-saved DeepSpeed layout])."""
    dp = comm.get_world_size()
    pieces, scalars, group_of = _deepspeed_pieces(state, names, dp, dp_rank)
    group_names = _module_order_groups(state, names, group_of)
    src = _source(state, names, group_names)
    src.client_state = dict(client_state)
    zero_cfg = (state.ds_config or {}).get("zero_optimization") or {}
    sub_group_size = int(zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    flats, states, hyper, records, layouts, index = [], {}, [], [], [], 0
    for gi, group in enumerate(group_names):
        numels = [math.prod(names.specs[n]["shape"]) for n in group]
        parts = [stage3_partition(n, dp) for n in numels]
        indices = []
        for members in sub_groups(parts, sub_group_size):
            chosen = [group[i] for i in members]
            keys = [k for k in pieces[chosen[0]] if all(k in pieces[n] for n in chosen)]
            flat = {k: torch.cat([pieces[n][k] for n in chosen]) for k in keys}
            scalar = dict(scalars[chosen[0]])
            states[index] = {**scalar, **{k: v for k, v in flat.items() if k != FP32}}
            flats.append(flat[FP32])
            records.append({"master": flat[FP32], "state": states[index]})  # the same tensors
            offset, kept = 0, []
            for i in members:
                lo = dp_rank * parts[i]
                if (n := min(parts[i], numels[i] - lo)) > 0:
                    kept.append(Piece(group[i], lo, offset, n))
                offset += parts[i]
            elementwise = tuple(k for k in keys if k != FP32)
            layouts.append(EntryLayout(gi, offset, tuple(kept), elementwise, tuple(scalar)))
            indices.append(index)
            index += 1
        hyper.append(_hyper(src, gi, indices))
    osd = stage3_optimizer_state(src, dp, states, hyper, flats)
    shard = {**header, "entries": records, "optimizer_state_dict": osd, "ds_config": _ds_config(src, 3)}
    return shard, layouts, _model_states(src, 3, dp, OrderedDict())


def _full_state(state: TrainingState, names: CheckpointNames) -> tuple[UniversalState, dict[str, int]]:
    """Collective: every trainable parameter's full fp32 master and elementwise optimizer state and its
    scalar state (`_full_entries`, all held at once); name -> param group."""
    tensors, scalars, group_of = {}, {}, {}
    for name, full, scalar, gi in _full_entries(state, names):
        tensors[name], scalars[name], group_of[name] = full, scalar, gi
    return UniversalState(tensors, scalars, group_of), group_of


def as_saved_stage12_rank_states(
    state: TrainingState, names: CheckpointNames, dp_rank: int, header: dict, client_state: dict
) -> tuple[dict, list[EntryLayout], list]:
    """Collective: (this rank's file: `header` + zerospeed's entries + DeepSpeed's ZeRO-1/2 `optimizer_state_dict`
    over the same tensors, the entries' layouts, DeepSpeed's `param_shapes`) (Note [as-saved ZeRO 1/2])."""
    dp, stage = comm.get_world_size(), state.zero.stage
    universal, group_of = _full_state(state, names)
    group_names = _module_order_groups(state, names, group_of)
    src = _source(state, names, group_names)
    src.universal, src.client_state = universal, dict(client_state)
    osd = _stage12_optim(src, stage, dp, dp_rank)
    src.universal = universal = None  # (the full state: only this rank's slices stay)
    records, layouts = [], []
    for gi, group in enumerate(group_names):
        flat = osd["single_partition_of_fp32_groups"][gi]
        n = flat.numel()
        numels = [math.prod(names.specs[name]["shape"]) for name in group]
        starts = dict(zip(group, [0, *itertools.accumulate(numels)]))
        size = n + osd["group_paddings"][gi]
        kept = tuple(
            Piece(name, dp_rank * size + start - starts[name], start, count)
            for name, count, start in slice_mappings(numels, group, dp_rank * size, dp_rank * size + n)
        )
        if not kept:
            continue  # (a slice of padding only)
        saved = osd["base_optimizer_state"]["state"].get(gi, {})
        elementwise, scalar = split_state(saved, size)
        # the entry's state: views of DeepSpeed's (padded) state tensors, so the file holds each value once
        entry_state = {**{k: saved[k][:n] for k in elementwise}, **{k: saved[k] for k in scalar}}
        records.append({"master": flat, "state": entry_state})
        layouts.append(EntryLayout(gi, n, kept, tuple(elementwise), tuple(scalar)))
    shard = {**header, "entries": records, "optimizer_state_dict": osd, "ds_config": _ds_config(src, stage)}
    shapes = [OrderedDict((name, torch.Size(names.specs[name]["shape"])) for name in g) for g in group_names]
    return shard, layouts, shapes


def _zero0_group_names(state: TrainingState, names: CheckpointNames, groups: dict[str, int]) -> list[list[str]]:
    """The trained parameters per optimizer param group in the order DeepSpeed's torch optimizer numbers them:
    the order the groups list them (`state.param_group_names`), else module order."""
    known = [[n for n in g if n in groups] for g in state.param_group_names]
    if len(known) == len(state.optimizer.param_groups) and sorted(n for g in known for n in g) == sorted(groups):
        return known
    return _module_order_groups(state, names, groups)


def _shaped(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`t` (detached) in `shape`: a view where `t` is contiguous, so its storage stays the one saved."""
    t = t.detach()
    return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def as_saved_stage0(state: TrainingState, names: CheckpointNames, model_states: dict | None) -> list[EntryLayout]:
    """Note [as-saved ZeRO 0]: put DeepSpeed's `optimizer` (the torch optimizer's state_dict in DeepSpeed's
    numbering) and zerospeed's `entries` (the same tensors) into `model_states` (this rank's model-states file;
    None on ranks that write none); the entries' layouts (in the strategy's entry order)."""
    if model_states is None:
        return []
    opt, module = state.optimizer, model_states["module"]
    entries = names.global_entries(state.zero.shard_entries(names.params))
    gis = entry_groups(opt, [e.master for e in entries])
    records, layouts, tensors, scalars = [], [], {}, {}
    for entry, gi in zip(entries, gis):
        (piece,) = entry.pieces  # (a whole parameter: ZeRO 0)
        name, shape = piece.name, names.specs[piece.name]["shape"]
        weight = module.get(name)
        fp32 = entry.master.float() if entry.master.dtype != torch.float32 else entry.master
        if weight is None or weight.dtype != torch.float32 or weight.numel() != entry.master.numel():
            weight = _shaped(fp32, shape)
        saved = opt.state.get(entry.master, {})
        elementwise, scalar = split_state(saved, entry.master.numel())
        tensors[name] = {k: (_shaped(v, shape) if k in elementwise else v) for k, v in saved.items()}
        scalars[name] = scalar
        records.append({"master": weight, "state": tensors[name]})
        layouts.append(EntryLayout(gi, entry.master.numel(), (piece,), tuple(elementwise), tuple(scalar)))
    group_names = _zero0_group_names(state, names, {p.name: gi for e, gi in zip(entries, gis) for p in e.pieces})
    ds_state, hyper, index = {}, [], 0
    for gi, group in enumerate(group_names):
        for name in group:
            if tensors.get(name):
                ds_state[index] = tensors[name]
            index += 1
        first = index - len(group)
        hyper.append(
            {
                **{k: copy.deepcopy(v) for k, v in opt.param_groups[gi].items() if k != "params"},
                "params": list(range(first, index)),
            }
        )
    model_states["optimizer"] = {"state": ds_state, "param_groups": hyper}
    model_states["entries"] = records
    return layouts
