"""DeepSpeed's AutoEP checkpoints at ZeRO 3: reading a tag DeepSpeed 0.19.8 saved from a transformers MoE model
under `"expert_parallel"` at ZeRO stage 3 (Note [DeepSpeed AutoEP ZeRO-3 checkpoints]).

Note [DeepSpeed AutoEP ZeRO-3 checkpoints]: DeepSpeed 0.19.8 refuses its native `MoE` at ZeRO 3; its ZeRO-3
MoE is AutoEP, which swaps each sparse-MoE block for its own layer: the router `mlp.router.gate.weight` (transformers'
`mlp.gate.weight`) and the stacked experts `mlp.experts.w1`, `w3` ([E/ep, I, H]: the gate and up halves of
transformers' `gate_up_proj [E, 2I, H]`, rows 0..I-1 and I..2I-1) and `w2` (`down_proj`, [E/ep, H, I]). Per rank
r the tag holds `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (`param_shapes`: the dense group, then the expert
group under this rank's local shapes; `ds_autoep_layers`: per block its `module_path`, `ep_size`,
`ep_rank`, `global_expert_start`, checkpoint_format `zero3_partitioned`) and `..._optim_states.pt` (per
ZeRO-3 sub-group a flat fp32 partition and its Adam moments; `ds_zero_partition_groups`: the dense sub-group
partitioned over all dp ranks, the expert sub-group over the rank's expert-data-parallel ranks
`partition_ranks`, each parameter cut into `ceil(numel / partition_count)` pieces as ZeRO 3 does).
This module reassembles each dense parameter from the dp ranks, each expert group's local tensors from its
expert-data-parallel ranks, stacks the ep ranks' experts in global order, and renames to transformers' names
(`w1`, `w3` concatenated on dim 1), giving deepspeed_import's universal form, which loads into zerospeed's
AutoEP (Note [stacked expert checkpoints] in experts.py) at any stage / ep. Read: fp32 and bf16 runs (a bf16 run's
optimizer files are `bf16_zero_pp_rank_*`, their fp32 masters read as they are) with one dense and one
expert param group (DeepSpeed's default sub_group_size), one ep size; anything else is refused naming the tag.
Tested on tags with ep 2 on 2 and on 4 ranks (expert-data-parallel groups of 1 and of 2 ranks, whose pieces follow
`partition_ranks` order, e.g. [1, 3]), and bf16 on autoep_zero3_ep2_bf16. ZeRO-1/2 AutoEP tags:
deepspeed_autoep_zero12.py, ZeRO-0 ones: deepspeed_autoep_zero0.py (both through `autoep_checkpoint` below).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zerospeed.checkpoint import deepspeed_autoep_names as names_
from zerospeed.checkpoint.deepspeed_experts import MOE_RESERVED
from zerospeed.checkpoint.deepspeed_import import (
    RESERVED,
    DeepSpeedCheckpoint,
    _hyperparameters,
    _load,
    _loss_scale,
    _optim_files,
    _scalars,
    model_meta,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32, UniversalState

ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


def is_deepspeed_autoep_zero3_tag(tag_dir: Path) -> bool:
    """A ZeRO-3 tag DeepSpeed's AutoEP saved (model states with partitioned `ds_autoep_layers`)."""
    path = Path(tag_dir) / ZERO3_MODEL.format(0)
    return not (Path(tag_dir) / "zero").is_dir() and autoep_format(path) == "zero3_partitioned"


def autoep_format(path: Path) -> str | None:
    """The checkpoint_format every `ds_autoep_layers` entry of the model-states file `path` records (None: no such
    file, no AutoEP layers, or several formats)."""
    if not path.exists():
        return None
    formats = {e.get("checkpoint_format") for e in _load(path).get("ds_autoep_layers") or []}
    return formats.pop() if len(formats) == 1 else None


def _transformers_name(name: str, prefixes: dict[str, str]) -> str:
    for ds, ours in prefixes.items():
        if name.startswith(ds):
            return ours + name[len(ds) :]
    return name


def read_deepspeed_autoep_zero3_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form (transformers' names, whole [E, ...] experts) of a DeepSpeed AutoEP ZeRO-3 tag."""
    del group_names  # (a ZeRO-3 tag names its parameters)
    tag_dir = Path(tag_dir)
    model, dp, ds_config = read_autoep_model(tag_dir, ZERO3_MODEL.format(0))
    if isinstance(ds_config.get("fp16"), dict) and ds_config["fp16"].get("enabled"):
        raise CheckpointError(f"{tag_dir}: a fp16 DeepSpeed AutoEP checkpoint is not read here; fp32 and bf16 runs are")
    models = [model] + [_load(tag_dir / ZERO3_MODEL.format(r)) for r in range(1, dp)]
    optims = _optim_files(tag_dir, dp)  # (a bf16 run's `bf16_zero_pp_rank_*`: optim_prefix)
    subs = optims[0].get("ds_zero_partition_groups") or []
    families = [tuple(s.get("families") or ()) for s in subs]
    if families != [("replicated",), ("autoep_expert",)] or len(model["param_shapes"]) != 2:
        raise CheckpointError(
            f"{tag_dir}: AutoEP ZeRO-3 sub-groups {families} over {len(model['param_shapes'])} param groups; only "
            "one dense and one expert group (DeepSpeed's default sub_group_size) are read here"
        )
    ep = autoep_ep_size(tag_dir, model)

    def flat(r: int, sub: int) -> dict[str, torch.Tensor]:
        osd = optims[r]
        state = osd["optimizer_state_dict"]["state"][sub]
        out = {FP32: osd["fp32_flat_groups"][sub].reshape(-1)}
        out.update({k: v.reshape(-1) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0})
        return out

    def gather(ranks: list[int], sub: int, shapes: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Each parameter of sub-group `sub` whole, from its pieces on `ranks` (ZeRO 3's per-parameter cut)."""
        flats = [flat(r, sub) for r in ranks]
        out, offset = {}, 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / len(ranks))
            out[name] = {
                k: torch.cat([f[k][offset : offset + part] for f in flats])[:numel].view(shape) for k in flats[0]
            }
            offset += part
        if offset > flats[0][FP32].numel():
            raise CheckpointError(f"{tag_dir}: sub-group {sub} needs {offset} elements per rank, holds fewer")
        return out

    tensors = gather(list(subs[0]["partition_ranks"]), 0, dict(model["param_shapes"][0]))
    if list(subs[0]["partition_ranks"]) != list(range(dp)):
        raise CheckpointError(f"{tag_dir}: the dense sub-group is not partitioned over all {dp} ranks")
    per_ep: dict[int, dict] = {}
    for r in range(dp):
        entry = models[r]["ds_autoep_layers"][0]
        e_rank = int(entry["ep_rank"])
        if e_rank not in per_ep and int(entry["expert_data_parallel_rank"]) == 0:
            ranks = list(optims[r]["ds_zero_partition_groups"][1]["partition_ranks"])
            per_ep[e_rank] = gather(ranks, 1, dict(models[r]["param_shapes"][1]))
    if sorted(per_ep) != list(range(ep)):
        raise CheckpointError(f"{tag_dir}: experts of ep ranks {sorted(per_ep)} found, {ep} expected")
    for name in per_ep[0]:
        tensors[name] = {k: torch.cat([per_ep[e][name][k] for e in range(ep)]) for k in per_ep[0][name]}
    scalars = [_scalars(optims[0]["optimizer_state_dict"]["state"].get(g, {})) for g in (0, 1)]
    osd = optims[0]
    return autoep_checkpoint(
        tag_dir,
        3,
        dp,
        model,
        tensors,
        scalars,
        osd["optimizer_state_dict"]["param_groups"],
        osd.get("loss_scaler"),
        names,
    )


def read_autoep_model(tag_dir: Path, file: str) -> tuple[dict, int, dict]:
    """(model states, dp, ds_config) of a DeepSpeed AutoEP tag's model file `file`; a tensor-parallel tag is
    refused. Shared by the ZeRO-0 and ZeRO-1/2 readers."""
    model = _load(tag_dir / file)
    if int(model.get("mp_world_size") or 1) > 1 or any(tag_dir.glob("*mp_rank_01*")):
        raise CheckpointError(f"{tag_dir}: a tensor-parallel DeepSpeed AutoEP checkpoint is not read here")
    return model, int(model.get("dp_world_size") or 1), model.get("ds_config") or {}


def autoep_ep_size(tag_dir: Path, model: dict) -> int:
    """The one ep size of a tag's `ds_autoep_layers` (several are refused)."""
    sizes = {int(e["ep_size"]) for e in model["ds_autoep_layers"]}
    if len(sizes) != 1:
        raise CheckpointError(f"{tag_dir}: AutoEP layers of several ep sizes are not read here")
    return sizes.pop()


def autoep_checkpoint(
    tag_dir: Path, stage: int, dp: int, model: dict, tensors: dict, scalars: list, groups: list, scaler, names
) -> DeepSpeedCheckpoint:
    """deepspeed_import's universal form of an AutoEP tag from `tensors` (DeepSpeed's names -> {state: tensor},
    the experts stacked to [E, ...]): transformers' names (router.gate -> gate, w1 | w3 -> gate_up_proj,
    w2 -> down_proj); `scalars` per param group (dense, expert), `groups` the saved param groups. Shared by the
    ZeRO-3 reader here and the ZeRO-1/2 one (deepspeed_autoep_zero12.py)."""
    layers = model["ds_autoep_layers"]
    ep = int(layers[0]["ep_size"])
    uni = UniversalState()
    renames = {}
    for entry in layers:
        path, prefix = entry["module_path"], entry["expert_key_prefix"]
        renames.update(names_.router_renames(path))  # Note [DeepSpeed AutoEP names]
        w1, w2, w3 = (tensors.pop(f"{prefix}.{w}") for w in names_.EXPERT_WEIGHTS)
        fused = {k: names_.to_transformers(w1[k], w2[k], w3[k]) for k in w1}
        tensors[f"{prefix}.{names_.GATE_UP}"] = {k: v[0] for k, v in fused.items()}
        tensors[f"{prefix}.{names_.DOWN}"] = {k: v[1] for k, v in fused.items()}
    expert_names = {f"{e['expert_key_prefix']}.{w}" for e in layers for w in (names_.GATE_UP, names_.DOWN)}
    group_names: list[list[str]] = [[], []]
    for name, value in tensors.items():
        ours = _transformers_name(name, renames)
        gi = 1 if name in expert_names else 0
        group_names[gi].append(ours)
        if names is None or ours in names:
            uni.tensors[ours] = {k: v.reshape(-1) for k, v in value.items()}
            uni.scalars[ours], uni.groups[ours] = dict(scalars[gi]), gi
    shapes = {_transformers_name(n, renames): tuple(v[FP32].shape) for n, v in tensors.items()}
    buffers = set(model.get("buffer_names") or [])
    if model.get("frozen_param_shapes"):
        raise CheckpointError(f"{tag_dir}: frozen weights in a DeepSpeed AutoEP checkpoint are not read here")
    ckpt = DeepSpeedCheckpoint(
        tag_dir,
        stage,
        dp,
        uni,
        {n: t for n, t in model["module"].items() if n in buffers},
        _hyperparameters(groups),
        meta=_loss_scale(scaler),
    )
    ckpt.meta = model_meta(model) | ckpt.meta
    ckpt.meta["ep_size"] = ep
    ckpt.client_state = {k: v for k, v in model.items() if k not in RESERVED | MOE_RESERVED}
    ckpt.layout = {
        "group_names": group_names,
        "shapes": shapes,
        "module_keys": [_transformers_name(n, renames) for n in model["module"] if not n.endswith(".gate.gate.weight")],
        "buffer_names": sorted(buffers),
        "shared_params": dict(model.get("shared_params") or {}),
    }
    return ckpt
