"""DeepSpeed's MoE checkpoints: reading a tag DeepSpeed saved from a model with `MoE` layers, and writing a
zerospeed MoE checkpoint in that layout (Note [DeepSpeed MoE checkpoints]).

Note [DeepSpeed MoE checkpoints]: DeepSpeed 0.19.8's engine (`_save_moe_checkpoint`) writes, for a model
with `deepspeed.moe.layer.MoE` layers and data / expert parallelism only,
- `mp_rank_00_model_states.pt` as without MoE but without the experts (the gate `wg` stays), plus
  `num_experts`: the layers' expert counts, a list in module order;
- per MoE layer i (counted in module order) and global expert e, `layer_{i}_expert_{e}_mp_rank_00_model_states.pt`:
  that expert's state dict under its global name (`...deepspeed_moe.experts.deepspeed_experts.{e}...`),
  written by expert-data-parallel rank 0 of the expert's ep rank. Global expert e is local expert
  j = e - ep_rank * E / ep of expert-parallel rank ep_rank, and DeepSpeed's default layout puts data-parallel
  rank r at ep_rank = r % ep (expert-parallel groups of consecutive ranks);
- ZeRO 0: per ep rank e of the largest ep size, `expp_rank_{e}_mp_rank_00_optim_states.pt` = {"optimizer":
  that rank's torch optimizer `state_dict()`}, its states by position: the dense groups' parameters and, in
  the `moe: True` groups, that rank's local experts (module order: layer, local expert, parameter);
- ZeRO 1/2: the usual `zero_pp_rank_{r}_...optim_states.pt` per data-parallel rank; a `moe` group is
  partitioned over the expert-data-parallel group (dp / ep ranks, its `partition_count`), its
  `param_slice_mappings` and the model file's `param_shapes` name local experts (rank 0's, in the model
  file). ep = dp / partition_count of the group.
This module reads such a tag into the universal form of deepspeed_import (`DeepSpeedCheckpoint`) with every
expert under its global name, as zerospeed's own checkpoints name them (Note [global expert names] in
experts.py), so it loads at any ep, dp and ZeRO stage. There is no ZeRO-3 native MoE tag to read: DeepSpeed
0.19.8's engine refuses `MoE` layers at ZeRO 3 (`_validate_zero3_moe_compatibility`: "Native DeepSpeed MoE is
not supported with ZeRO Stage 3. Use AutoEP ..."). Its ZeRO-3 MoE is AutoEP, whose tags (model states with
`ds_autoep_layers`) this reader and deepspeed_import's refuse (`refuse_autoep`): a ZeRO-3 one is read by
deepspeed_autoep.py (Note [DeepSpeed AutoEP ZeRO-3 checkpoints]), a ZeRO 0-2 one (layer_i_expert_e files under
AutoEP's own names) by deepspeed_autoep_zero12.py / deepspeed_autoep_zero0.py (its ZeRO-0 reader follows
`_read_zero0` below); fixtures autoep_zero{0,1,2,3}_ep2. Refused too, with an error
naming the tag: MoE groups of several ep sizes, expert buffers, and what deepspeed_import refuses (tensor /
pipeline parallelism).
The other way, `write_deepspeed_moe_tag` cuts an export source whose experts carry global names (a zerospeed
checkpoint) into that layout for ZeRO 0-2 at a chosen ep: per ep rank a view with that rank's experts under
local names, written with deepspeed_export's own pieces (the dense groups partitioned over dp, the MoE groups
over the dp / ep expert-data-parallel ranks, rank r holding ep rank r % ep's experts).
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from pathlib import Path

import torch

from zerospeed.checkpoint.atomic import fresh_dir
from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.deepspeed_export import (
    DS_LAYOUT_VERSION,
    ExportSource,
    _ds_config,
    _frozen_fragments,
    _model_states,
    _save,
    _stage0_optimizer,
    _stage12_optim,
    _weight,
    publish_tag,
    read_zerospeed_source,
)
from zerospeed.checkpoint.deepspeed_import import (
    MODEL,
    RESERVED,
    DeepSpeedCheckpoint,
    _elementwise,
    _hyperparameters,
    _load,
    _loss_scale,
    _optim_files,
    _scalars,
    model_meta,
    optim_prefix,
    refuse_autoep,
    stage12_universal,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32, UniversalState

EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
EXPERT_KEY = re.compile(r"(.*\.deepspeed_moe\.experts\.deepspeed_experts)\.(\d+)\.(.*)")
MOE_RESERVED = frozenset({"num_experts", "ds_autoep_layers"})


def is_deepspeed_moe_tag(tag_dir: Path) -> bool:
    """A DeepSpeed tag with MoE expert files (Note [DeepSpeed MoE checkpoints])."""
    tag_dir = Path(tag_dir)
    return (tag_dir / MODEL).exists() and any(EXPERT_FILE.fullmatch(p.name) for p in tag_dir.glob("layer_*_expert_*"))


def expp_file(ep_rank: int) -> str:
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


class _Experts:
    """The tag's MoE layers: each one's expert-list prefix and expert count, and the ep size."""

    def __init__(self, tag_dir: Path, model: dict):
        self.tag_dir = tag_dir
        counts = model.get("num_experts")
        if not isinstance(counts, list):
            raise CheckpointError(
                f"{tag_dir}: {MODEL} has no per-layer num_experts list (an old-style DeepSpeed MoE "
                "checkpoint, before layer_{i}_expert_{e} files); load it in DeepSpeed and save it again"
            )
        self.counts = [int(c) for c in counts]
        self.prefixes: list[str] = []
        for i, count in enumerate(self.counts):
            path = tag_dir / f"layer_{i}_expert_0_mp_rank_00_model_states.pt"
            if not path.exists():
                raise CheckpointError(f"{tag_dir}: {path.name} is missing ({len(self.counts)} MoE layers)")
            match = next((EXPERT_KEY.fullmatch(k) for k in _load(path)), None)
            if match is None:
                raise CheckpointError(f"{path}: no '...deepspeed_experts.0....' key: not a DeepSpeed MoE expert file")
            self.prefixes.append(match.group(1))
            if not (tag_dir / f"layer_{i}_expert_{count - 1}_mp_rank_00_model_states.pt").exists():
                raise CheckpointError(f"{tag_dir}: layer {i} has {count} experts but no file for expert {count - 1}")
        self.ep = 0
        self._values: dict[str, torch.Tensor] | None = None

    def set_ep(self, ep: int, why: str) -> None:
        if self.ep and ep != self.ep:
            raise CheckpointError(
                f"{self.tag_dir}: MoE param groups of several expert-parallel sizes ({self.ep}, {ep}) are not "
                "read here; convert it with DeepSpeed's zero_to_fp32.py and load the weights"
            )
        if any(c % ep for c in self.counts):
            raise CheckpointError(f"{self.tag_dir}: ep size {ep} ({why}) does not divide the experts {self.counts}")
        self.ep = ep

    def globalize(self, name: str, ep_rank: int) -> str:
        """The global name of local expert parameter `name` on expert-parallel rank `ep_rank`."""
        match = EXPERT_KEY.fullmatch(name)
        if match is None:
            raise CheckpointError(f"{self.tag_dir}: {name} is in a MoE param group but is no MoE layer's expert")
        local = self.local_count(match.group(1))
        return f"{match.group(1)}.{ep_rank * local + int(match.group(2))}.{match.group(3)}"

    def expert_values(self) -> dict[str, torch.Tensor]:
        """Every expert tensor of the expert files, under its global name (memory-mapped)."""
        if self._values is None:
            self._values = {}
            for i, count in enumerate(self.counts):
                for e in range(count):
                    self._values.update(_load(self.tag_dir / f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt"))
        return self._values

    def local_count(self, prefix: str) -> int:
        if prefix not in self.prefixes:
            raise CheckpointError(
                f"{self.tag_dir}: no expert file of a MoE layer {prefix} (its layers: {self.prefixes})"
            )
        return self.counts[self.prefixes.index(prefix)] // self.ep


def read_deepspeed_moe_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form of a DeepSpeed MoE tag, experts under global names (the named trainable
    parameters only, all when None). `group_names`: the loading model's trainable parameters per param
    group (local names); at ZeRO 0 they say which parameters a dense group's positions are and which
    parameters of an expert its MoE group holds."""
    tag_dir = Path(tag_dir)
    model = _load(tag_dir / MODEL)
    refuse_autoep(tag_dir, model)  # (its ZeRO 0-2 tags have layer_i_expert_e files too)
    if int(model.get("mp_world_size") or 1) > 1 or any(tag_dir.glob("*mp_rank_01*")):
        raise CheckpointError(f"{tag_dir}: a tensor-parallel DeepSpeed MoE checkpoint is not read here")
    experts = _Experts(tag_dir, model)
    dp = int(model.get("dp_world_size") or 1)
    if optim_prefix(tag_dir) is not None:
        ckpt = _read_zero12(tag_dir, model, experts, dp, names)
    elif (tag_dir / expp_file(0)).exists():
        ckpt = _read_zero0(tag_dir, model, experts, dp, names, group_names)
    else:
        raise CheckpointError(
            f"{tag_dir}: neither zero_pp_rank_* nor expp_rank_* optimizer files (DeepSpeed 0.19.8 saves its "
            "MoE only at ZeRO 0-2); convert it with DeepSpeed's zero_to_fp32.py and load the weights"
        )
    extra = sorted(k for k in experts.expert_values() if k not in ckpt.layout["shapes"])
    if extra:
        raise CheckpointError(
            f"{tag_dir}: the expert files hold tensors that are no trainable parameter ({extra[:3]}: expert "
            "buffers or frozen expert weights), which this reader does not load"
        )
    ckpt.meta = model_meta(model) | ckpt.meta
    ckpt.meta["ep_size"] = experts.ep
    ckpt.client_state = {k: v for k, v in model.items() if k not in RESERVED | MOE_RESERVED}
    return ckpt


def _layout(model: dict, shapes: list[dict], experts: _Experts) -> dict:
    return {
        "group_names": [list(g) for g in shapes],
        "shapes": {n: tuple(int(d) for d in s) for g in shapes for n, s in g.items()},
        "module_keys": list(model["module"]),
        "buffer_names": list(model.get("buffer_names") or []),
        "shared_params": dict(model.get("shared_params") or {}),
        "moe": {"num_experts": experts.counts, "prefixes": experts.prefixes, "ep_size": experts.ep},
    }


def _read_zero12(tag_dir: Path, model: dict, experts: _Experts, dp: int, names) -> DeepSpeedCheckpoint:
    ranks = _optim_files(tag_dir, dp)
    if "single_partition_of_fp32_groups" not in ranks[0]:
        raise CheckpointError(
            f"{tag_dir}: the optimizer files hold no ZeRO 1/2 partitions (single_partition_of_fp32_groups); "
            "DeepSpeed 0.19.8 saves its MoE only at ZeRO 0-2 (at ZeRO 3 it refuses its native MoE)"
        )
    base = ranks[0]["base_optimizer_state"]
    moe_groups = [bool(g.get("moe")) for g in base["param_groups"]]
    for gi, is_moe in enumerate(moe_groups):
        if is_moe:
            experts.set_ep(dp // int(ranks[0]["partition_count"][gi]), f"group {gi}'s partition_count")
    shapes = []
    for gi, group in enumerate(model["param_shapes"]):
        if not moe_groups[gi]:
            shapes.append(dict(group))
            continue
        shapes.append({experts.globalize(n, e): s for e in range(experts.ep) for n, s in group.items()})

    def rename(name, rank, gi):  # rank order: an expert's edp ranks in order (rank = edp_rank x ep + ep_rank)
        return experts.globalize(name, rank % experts.ep) if moe_groups[gi] else name

    uni = stage12_universal(tag_dir, ranks, shapes, names, rename)
    return DeepSpeedCheckpoint(
        tag_dir,
        int(ranks[0].get("zero_stage", 1)),
        dp,
        uni,
        dict(model["module"]),
        _hyperparameters(base["param_groups"]),
        meta=_loss_scale(ranks[0].get("loss_scaler")),
        layout=_layout(model, shapes, experts),
    )


def _read_zero0(tag_dir: Path, model: dict, experts: _Experts, dp: int, names, group_names) -> DeepSpeedCheckpoint:
    ep = len(list(tag_dir.glob("expp_rank_*_mp_rank_00_optim_states.pt")))
    experts.set_ep(ep, "the expp_rank_* files")
    optims = [_load(tag_dir / expp_file(e))["optimizer"] for e in range(ep)]
    groups = optims[0]["param_groups"]
    if group_names is None or len(group_names) != len(groups):
        raise CheckpointError(
            f"{tag_dir}: the ZeRO-0 DeepSpeed MoE checkpoint has {len(groups)} optimizer param groups and names "
            f"none of their parameters; load it into an engine with the same {len(groups)} groups (DeepSpeed's "
            "split_params_into_different_moe_groups_for_optimizer)"
        )
    values = experts.expert_values()
    module = dict(model["module"])
    uni, shapes = UniversalState(), []
    for gi, group in enumerate(groups):
        per_rank = [_moe_order(group_names[gi], experts, e) for e in range(ep)] if group.get("moe") else None
        shapes.append({})
        for e, optim in enumerate(optims if per_rank else optims[:1]):
            order = per_rank[e] if per_rank else group_names[gi]
            keys = optim["param_groups"][gi]["params"]
            if len(keys) != len(order):
                raise CheckpointError(
                    f"{tag_dir}: {expp_file(e)} holds {len(keys)} parameters in param group {gi}, the loading "
                    f"model's group has {len(order)}; is it a checkpoint of this model?"
                )
            for key, name in zip(keys, order):
                source = values if per_rank else module
                if name not in source:
                    raise CheckpointError(f"{tag_dir}: no weights for {name} in the model or expert files")
                value = source[name].float().reshape(-1)
                shapes[-1][name] = tuple(source[name].shape)
                if names is not None and name not in names:
                    continue
                state = optim["state"].get(key, {})
                uni.tensors[name] = {FP32: value, **_elementwise(state, value.numel())}
                uni.scalars[name], uni.groups[name] = _scalars(state), gi
    return DeepSpeedCheckpoint(
        tag_dir, 0, dp, uni, module, _hyperparameters(groups), layout=_layout(model, shapes, experts)
    )


def _moe_order(local_names: list[str], experts: _Experts, ep_rank: int) -> list[str]:
    """The global names of ep rank `ep_rank`'s positions in a ZeRO-0 MoE param group: per layer (in the
    group's order), each of its local experts at the saved ep, each parameter an expert holds (the loading
    model's expert 0 of that layer says which)."""
    per_layer: dict[str, list[str]] = {}
    for name in local_names:
        match = EXPERT_KEY.fullmatch(name)
        if match is None:
            raise CheckpointError(f"{experts.tag_dir}: {name} is in a MoE param group but is no MoE layer's expert")
        rests = per_layer.setdefault(match.group(1), [])
        if match.group(2) == "0":
            rests.append(match.group(3))
    out = []
    for prefix, rests in per_layer.items():
        local = experts.local_count(prefix)
        out += [f"{prefix}.{ep_rank * local + j}.{rest}" for j in range(local) for rest in rests]
    return out


# ---- export: a zerospeed MoE checkpoint in DeepSpeed's MoE layout ----


def moe_layers(names) -> dict[str, int]:
    """The MoE layers among parameter names under global expert names: each layer's expert-list prefix ->
    its expert count, in the order the names first show them (module order: layer i of the expert files)."""
    experts: dict[str, set[int]] = {}
    for name in names:
        if (match := EXPERT_KEY.fullmatch(name)) is not None:
            experts.setdefault(match.group(1), set()).add(int(match.group(2)))
    for prefix, ids in experts.items():
        if ids != set(range(len(ids))):
            raise CheckpointError(f"the checkpoint holds experts {sorted(ids)} of {prefix}, not 0..{len(ids) - 1}")
    return {prefix: len(ids) for prefix, ids in experts.items()}


def _moe_groups(src: ExportSource) -> list[bool]:
    out = []
    for gi, names in enumerate(src.group_names):
        kinds = {EXPERT_KEY.fullmatch(n) is not None for n in names}
        if len(kinds) > 1:
            raise CheckpointError(
                f"export to DeepSpeed: optimizer param group {gi} mixes experts and dense parameters; DeepSpeed's "
                "MoE needs them apart (split_params_into_different_moe_groups_for_optimizer)"
            )
        out.append(kinds == {True})
    return out


def _ep_view(src: ExportSource, layers: dict[str, int], moe: list[bool], ep: int, ep_rank: int) -> ExportSource:
    """`src` as expert-parallel rank `ep_rank` of `ep` holds it: its own experts under local names (and the
    dense parameters), the experts left out of the module."""
    group_names, tensors, scalars, groups = [], {}, {}, {}
    for gi, names in enumerate(src.group_names):
        mine = []
        for name in names:
            local = name
            if moe[gi]:
                match = EXPERT_KEY.fullmatch(name)
                per_rank = layers[match.group(1)] // ep
                j = int(match.group(2)) - ep_rank * per_rank
                if not 0 <= j < per_rank:
                    continue
                local = f"{match.group(1)}.{j}.{match.group(3)}"
            mine.append(local)
            tensors[local] = src.universal.tensors[name]
            scalars[local] = src.universal.scalars.get(name, {})
            groups[local] = gi
        group_names.append(mine)
    param_groups = [
        {**g, "name": f"ep_size_{ep}"} if moe[gi] and re.fullmatch(r"ep_size_\d+", str(g.get("name"))) else dict(g)
        for gi, g in enumerate(src.param_groups)
    ]
    return dataclasses.replace(
        src,
        universal=UniversalState(tensors, scalars, groups),
        group_names=group_names,
        param_groups=param_groups,
        module_keys=[k for k in src.module_keys if EXPERT_KEY.fullmatch(k) is None],
    )


def _splice(dense: dict, experts: dict, moe: list[bool]) -> dict:
    """A rank's ZeRO-1/2 optimizer state: the dense groups partitioned over dp (`dense`), the MoE groups over
    the expert-data-parallel ranks (`experts`)."""
    out = dict(dense)
    for key in ("single_partition_of_fp32_groups", "group_paddings", "param_alignment_paddings", "partition_count"):
        out[key] = [experts[key][gi] if m else v for gi, (v, m) in enumerate(zip(dense[key], moe))]
    out["param_slice_mappings"] = [
        experts["param_slice_mappings"][gi] if m else v
        for gi, (v, m) in enumerate(zip(dense["param_slice_mappings"], moe))
    ]
    state = {gi: (experts if moe[gi] else dense)["base_optimizer_state"]["state"].get(gi) for gi in range(len(moe))}
    out["base_optimizer_state"] = {
        "state": {gi: s for gi, s in state.items() if s is not None},
        "param_groups": dense["base_optimizer_state"]["param_groups"],
    }
    return out


def write_deepspeed_moe_tag(src: ExportSource, out_dir, tag: str, *, stage: int, dp: int, ep: int) -> Path:
    """Write a source whose experts carry global names (a zerospeed MoE checkpoint) as DeepSpeed 0.19.8's MoE
    tag `out_dir/tag` for ZeRO `stage` (0-2) on `dp` ranks at expert-parallel size `ep` (Note [DeepSpeed MoE
    checkpoints]), and point `out_dir/latest` at it. Returns the tag directory."""
    layers = moe_layers(n for g in src.group_names for n in g)
    if stage not in (0, 1, 2):
        raise CheckpointError(
            f"export of a MoE checkpoint to DeepSpeed at ZeRO stage {stage}: only ZeRO 0-2 are written (DeepSpeed "
            "0.19.8 refuses its native MoE at ZeRO 3: 'Native DeepSpeed MoE is not supported with ZeRO Stage 3'), "
            "so no DeepSpeed engine would load such a tag; export at stage 0, 1 or 2"
        )
    if src.param_dtype != torch.float32:
        raise CheckpointError(
            f"export of a MoE checkpoint to DeepSpeed with {src.param_dtype} weights: only fp32 runs are written"
        )
    if ep < 1 or dp % ep or any(count % ep for count in layers.values()):
        raise CheckpointError(
            f"export to DeepSpeed at ep {ep}: it must divide the data-parallel size {dp} and every MoE layer's "
            f"experts {list(layers.values())}; pass another --ep"
        )
    frozen = [k for k in src.module if EXPERT_KEY.fullmatch(k) is not None]
    if frozen:
        raise CheckpointError(
            f"export to DeepSpeed: expert buffers or frozen expert weights ({frozen[:3]}) are not written"
        )
    moe = _moe_groups(src)
    views = [_ep_view(src, layers, moe, ep, e) for e in range(ep)]
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{tag}.partial"
    fresh_dir(staging)
    states = _model_states(views[0], stage, dp, _frozen_fragments(views[0], stage, dp, 0))
    states.update(num_experts=list(layers.values()), ds_autoep_layers=None)
    if "universal_checkpoint_info" not in src.client_state:  # (DeepSpeed's native MoE tags carry none)
        states.pop("universal_checkpoint_info", None)
    _save(states, staging / MODEL)
    for i, (prefix, count) in enumerate(layers.items()):
        for e in range(count):
            head = f"{prefix}.{e}."
            expert = OrderedDict((n, _weight(src, n)) for g in src.group_names for n in g if n.startswith(head))
            _save(expert, staging / f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt")
    if stage == 0:
        for e, view in enumerate(views):
            _save({"optimizer": _stage0_optimizer(view)}, staging / expp_file(e))
    for r in range(dp if stage > 0 else 0):
        view = views[r % ep]
        osd = _splice(_stage12_optim(view, stage, dp, r), _stage12_optim(view, stage, dp // ep, r // ep), moe)
        _save(
            {"optimizer_state_dict": osd, "ds_config": _ds_config(view, stage), "ds_version": DS_LAYOUT_VERSION},
            staging / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )
    return publish_tag(root, staging, tag)


def export_moe_to_deepspeed(
    checkpoint_dir,
    output_dir,
    *,
    stage: int,
    dp: int,
    ep: int,
    tag: str | None = None,
    output_tag: str | None = None,
    group_names: list[list[str]] | None = None,
) -> Path:
    """Export a zerospeed checkpoint of a model with MoE layers as DeepSpeed 0.19.8's MoE tag for ZeRO `stage`
    on `dp` ranks at expert-parallel size `ep` (`write_deepspeed_moe_tag`; `zerospeed-ckpt export --ep`)."""
    tag_dir, _ = resolve_checkpoint(checkpoint_dir, tag)
    src = read_zerospeed_source(checkpoint_dir, tag, group_names)
    return write_deepspeed_moe_tag(src, output_dir, output_tag or tag_dir.name, stage=stage, dp=dp, ep=ep)


def has_experts(checkpoint_dir, tag: str | None = None) -> bool:
    """Whether a zerospeed checkpoint holds MoE experts (global expert names in its manifest)."""
    _, manifest = resolve_checkpoint(checkpoint_dir, tag)
    return bool(moe_layers(manifest["parameters"]))
