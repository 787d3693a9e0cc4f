"""Writing a zerospeed AutoEP checkpoint as DeepSpeed 0.19.8's AutoEP tag (`zerospeed-ckpt export --to deepspeed
--stage S --dp N [--ep E]` on a checkpoint saved under `"expert_parallel"`), so that the real DeepSpeed's
`engine.load_checkpoint` resumes it under its AutoEP (Note [DeepSpeed AutoEP export]).

Note [DeepSpeed AutoEP export]: a zerospeed AutoEP checkpoint holds the transformers model's own names, each block's
experts whole (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`: Note [stacked expert checkpoints] in experts.py),
whatever ep and stage it was saved at. DeepSpeed's AutoEP tag at ZeRO S, ep E, dp N (E divides N and every block's
experts; rank r is ep rank r % E and expert-data-parallel rank r // E, its expert-data-parallel group the ranks
r % E, r % E + E, ...) is, per ep rank e, the tag of a model whose router is `router.gate` (with its alias
`gate.gate` in the module) and whose experts are e's rows of `w1`, `w2`, `w3` (Note [DeepSpeed AutoEP names]),
cut with deepspeed_export's pieces:
- ZeRO 0: as ZeRO 1/2's model and expert files, the model file also holding rank 0's torch optimizer state and no
  `param_shapes`, and per ep rank e `expp_rank_{e}_mp_rank_00_optim_states.pt` ({"optimizer": e's torch optimizer
  state: the dense parameters, then e's w1, w2, w3, by position});
- ZeRO 1/2: `mp_rank_00_model_states.pt` (rank 0's view: the dense weights, `param_shapes` with the local expert
  shapes, `num_experts`, `ds_autoep_layers` with checkpoint_format `per_expert_files`), one
  `layer_{l}_expert_{g}_mp_rank_00_model_states.pt` per global expert g ({`{prefix}.w1.{g}`: [I, H], w2, w3}), and
  per rank the ZeRO-1/2 optimizer file: the dense groups partitioned over the N ranks, the expert groups (`moe`,
  named `ep_size_E`) over the N / E expert-data-parallel ranks (deepspeed_experts' `_splice`, as DeepSpeed's native
  MoE);
- ZeRO 3: per rank its model states (empty parameters, its own `ds_autoep_layers` entry: ep rank, expert-data-parallel
  rank, checkpoint_format `zero3_partitioned`) and its ZeRO-3 optimizer file: each dense parameter cut over the N
  ranks, each expert parameter over the N / E expert-data-parallel ranks, one sub-group per param group, and
  `ds_zero_partition_groups` (which DeepSpeed's loader compares with its own placement, equal or refused).
`ds_autoep_layers` entries carry DeepSpeed's placement descriptor (contiguous: ep rank e holds experts
e * E' .. (e + 1) * E' - 1 for E' = experts / ep) and its affine maps (one piece per rank: those rows of the
[E, ...] tensor). The dense param group that has no name is named `dense-params`, as DeepSpeed names the group it
makes of a model's plain parameters. A DeepSpeed AutoEP tag read by deepspeed_autoep*.py is a source too
(`deepspeed_export.source_from_deepspeed`): rewritten for another stage / dp / ep without DeepSpeed. Tested: the
export of zerospeed's 3 steps equals DeepSpeed's own autoep_zero{0,1,2,3}_ep2 tags, and DeepSpeed's
tags rewrite to each other (ZeRO 2 <-> 3, dp 4) (tests/dist/test_deepspeed_autoep_export.py); the real DeepSpeed
resumes exports at other stages / ep (benchmarks/deepspeed_autoep_differential.py). Written: fp32 runs at ZeRO
0-3 and bf16 runs at ZeRO 1-3, without tensor parallelism or frozen expert weights, one ZeRO-3 sub-group per param
group. A bf16 run is DeepSpeed's bf16 AutoEP tag: the same files, the optimizer files named `bf16_zero_pp_rank_*`
(the ZeRO optimizer's fp32 masters and moments, as at fp32), the weights in the model states and per-expert files
the masters cast to bf16 (tests/dist/test_deepspeed_autoep_bf16_export.py: equal to DeepSpeed's
autoep_zero{1,2,3}_ep2_bf16 bit for bit). Refused: fp16 (DeepSpeed 0.19.8 builds no fp16 run on CPU to check one
against), bf16 at ZeRO 0 and at ZeRO 1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer files, not
written).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from pathlib import Path

import torch

from zerospeed.checkpoint import deepspeed_autoep_names as names_
from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.deepspeed_experts import _splice, expp_file
from zerospeed.checkpoint.deepspeed_export import (
    DS_LAYOUT_VERSION,
    ExportSource,
    _ds_config,
    _frozen_fragments,
    _model_states,
    _save,
    _stage0_optimizer,
    _stage3_optim,
    _stage12_optim,
    _uses_bf16_optimizer,
    _weight,
    publish_tag,
    read_zerospeed_source,
    stage_tag,
)
from zerospeed.checkpoint.deepspeed_import import BF16_PREFIX
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.naming import MODEL_STATES
from zerospeed.checkpoint.universal import FP32, UniversalState

MODEL = "mp_rank_00_model_states.pt"
UNIVERSAL_VERSION = 0.4  # DeepSpeed 0.19.8's universal_checkpoint_version
EXPERT_PATTERNS = [r".*\.experts\.w[123]$"]  # what DeepSpeed's AutoEP records as expert_parameter_patterns


@dataclasses.dataclass(frozen=True)
class Block:
    """One sparse-MoE block of the checkpoint: its module path and expert count."""

    path: str
    experts: int

    @property
    def prefix(self) -> str:  # DeepSpeed's expert_key_prefix, the experts' container in both models
        return f"{self.path}.experts"


def autoep_settings(ds_config: dict | None) -> dict | None:
    """A saved config's enabled `expert_parallel` block, or None (not an AutoEP run)."""
    block = (ds_config or {}).get("expert_parallel") or {}
    return block if isinstance(block, dict) and block.get("enabled") else None


def autoep_blocks(src: ExportSource) -> list[Block]:
    """The blocks whose experts the checkpoint holds stacked, in the optimizer's order (module order: DeepSpeed's
    moe_layer_id order)."""
    blocks = []
    for key in [n for g in src.group_names for n in g]:
        if key.endswith(f".experts.{names_.GATE_UP}"):
            path = key[: -len(f".experts.{names_.GATE_UP}")]
            needed = [f"{path}.experts.{names_.DOWN}", f"{path}.{names_.TRANSFORMERS_ROUTER}weight"]
            missing = [n for n in [key, *needed] if n not in src.universal.tensors]
            if missing:
                raise CheckpointError(
                    f"export to DeepSpeed's AutoEP: block {path} lacks {missing} among the trainable parameters "
                    "(frozen or missing router / experts are not written)"
                )
            blocks.append(Block(path, int(src.universal.tensors[key][FP32].shape[0])))
    return blocks


def _placement(experts: int, ep: int) -> dict:
    """DeepSpeed's contiguous expert placement descriptor."""
    local = experts // ep
    return {
        "version": 1,
        "num_experts": experts,
        "ep_size": ep,
        "ranks": [{"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)],
    }


def _strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _affine_map(logical: list[int], ep: int) -> dict:
    """DeepSpeed's affine map of an [E, ...] expert parameter placed contiguously: ep rank e's shard is one piece,
    rows e * E / ep .. of the whole tensor."""
    local = logical[0] // ep
    shard = [local, *logical[1:]]
    numel = math.prod(logical[1:])
    piece = {"shape": shard, "dest": [0, _strides(shard)]}
    return {
        "logical_shape": list(logical),
        "ranks": {
            e: {
                "shard_shape": list(shard),
                "pieces": [
                    {
                        "shape": list(shard),
                        "source": [e * local * numel, _strides(logical)],
                        "dest": piece["dest"],
                        "locations": [e],
                    }
                ],
            }
            for e in range(ep)
        },
    }


def autoep_layers(blocks: list[Block], shapes: dict, ep: int, dp: int, rank: int, stage: int) -> list[dict]:
    """DeepSpeed's `ds_autoep_layers` as rank `rank` of `dp` records it (`shapes`: each DeepSpeed expert weight's
    whole [E, ...] shape)."""
    e_rank = rank % ep
    out = []
    for i, block in enumerate(blocks):
        local = block.experts // ep
        maps = {
            f"{block.prefix}.{w}": _affine_map(list(shapes[f"{block.prefix}.{w}"]), ep) for w in names_.EXPERT_WEIGHTS
        }
        out.append(
            {
                "moe_layer_id": i,
                "module_path": block.path,
                "num_experts": block.experts,
                "num_local_experts": local,
                "ep_size": ep,
                "expert_placement": _placement(block.experts, ep),
                "affine_maps": {"version": 1, "params": maps},
                "expert_key_prefix": block.prefix,
                "checkpoint_format": "zero3_partitioned" if stage == 3 else "per_expert_files",
                "checkpoint_format_version": 1 if stage == 3 else None,
                "ep_group_name": f"ep_size_{ep}",
                "ep_rank": e_rank,
                "expert_data_parallel_rank": rank // ep,
                "expert_data_parallel_world_size": dp // ep,
                "global_expert_start": e_rank * local,
                "global_expert_end": (e_rank + 1) * local,
            }
        )
    return out


def _expert_groups(src: ExportSource, blocks: list[Block]) -> list[bool]:
    stacked = {f"{b.prefix}.{w}" for b in blocks for w in (names_.GATE_UP, names_.DOWN)}
    out = []
    for gi, names in enumerate(src.group_names):
        kinds = {n in stacked for n in names}
        if len(kinds) > 1:
            raise CheckpointError(
                f"export to DeepSpeed's AutoEP: optimizer param group {gi} mixes experts and dense parameters; "
                "DeepSpeed's AutoEP keeps them in separate groups"
            )
        out.append(kinds == {True})
    for b in blocks:
        where = [
            gi
            for gi, names in enumerate(src.group_names)
            for w in (names_.GATE_UP, names_.DOWN)
            if f"{b.prefix}.{w}" in names
        ]
        if len(set(where)) != 1:
            raise CheckpointError(
                f"export to DeepSpeed's AutoEP: {b.prefix}'s {names_.GATE_UP} and {names_.DOWN} are in param groups "
                f"{where}; DeepSpeed's AutoEP keeps a block's w1, w2, w3 in one group"
            )
    return out


def _local_experts(src: ExportSource, prefix: str, lo: int, hi: int) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's w1, w2, w3 (each {state: tensor}) of experts lo .. hi - 1 of the block whose experts are `prefix`."""
    gate_up, down = (src.universal.tensors[f"{prefix}.{w}"] for w in (names_.GATE_UP, names_.DOWN))
    shapes = gate_up[FP32].shape, down[FP32].shape
    split = {
        k: names_.to_autoep(gate_up[k].reshape(shapes[0])[lo:hi], down[k].reshape(shapes[1])[lo:hi]) for k in gate_up
    }
    return {
        f"{prefix}.{w}": {k: v[i].contiguous() for k, v in split.items()} for i, w in enumerate(names_.EXPERT_WEIGHTS)
    }


def ep_view(src: ExportSource, blocks: list[Block], moe: list[bool], ep: int, ep_rank: int) -> ExportSource:
    """`src` as DeepSpeed's AutoEP model on ep rank `ep_rank` holds it: the router under `router.gate` (its alias
    `gate.gate` tied to it in the module), this rank's rows of w1, w2, w3 in the expert groups, the experts out of
    the module (Note [DeepSpeed AutoEP names])."""
    routers = {f"{b.path}.{names_.TRANSFORMERS_ROUTER}": f"{b.path}.{names_.ROUTER}" for b in blocks}
    by_path = {b.prefix: b for b in blocks}

    def rename(name: str) -> str:
        for ours, theirs in routers.items():
            if name.startswith(ours):
                return theirs + name[len(ours) :]
        return name

    tensors, scalars, groups, group_names = {}, {}, {}, []
    for gi, names in enumerate(src.group_names):
        mine = []
        for name in names:
            uni = src.universal.tensors[name]
            shape = uni[FP32].shape
            if moe[gi]:
                prefix, _, weight = name.rpartition(".")
                if weight == names_.DOWN:
                    continue  # (written with its block's gate_up_proj, in DeepSpeed's w1, w2, w3 order)
                local = by_path[prefix].experts // ep
                for ds_name, value in _local_experts(src, prefix, ep_rank * local, (ep_rank + 1) * local).items():
                    tensors[ds_name] = value
                    scalars[ds_name], groups[ds_name] = src.universal.scalars.get(name, {}), gi
                    mine.append(ds_name)
                continue
            ds_name = rename(name)
            tensors[ds_name] = {k: v.reshape(shape) for k, v in uni.items()}
            scalars[ds_name], groups[ds_name] = src.universal.scalars.get(name, {}), gi
            mine.append(ds_name)
        group_names.append(mine)
    keys, tied = [], {rename(k): rename(v) for k, v in src.tied.items()}
    for key in src.module_keys:
        if any(key.startswith(b.prefix + ".") for b in blocks):
            continue
        keys.append(rename(key))
        for b in blocks:
            if key.startswith(f"{b.path}.{names_.TRANSFORMERS_ROUTER}"):
                alias = f"{b.path}.{names_.ROUTER_ALIAS}" + key[len(f"{b.path}.{names_.TRANSFORMERS_ROUTER}") :]
                keys.append(alias)
                tied[alias] = rename(key)
    param_groups = []
    for gi, g in enumerate(src.param_groups):
        if moe[gi]:
            g = {"name": f"ep_size_{ep}", "moe": True, **{k: v for k, v in g.items() if k not in ("name", "moe")}}
        elif "name" not in g:
            g = {"name": "dense-params", **g}
        param_groups.append(g)
    return dataclasses.replace(
        src,
        universal=UniversalState(tensors, scalars, groups),
        group_names=group_names,
        param_groups=param_groups,
        module={rename(k): v for k, v in src.module.items()},
        module_keys=keys,
        buffer_names=[rename(b) for b in src.buffer_names],
        tied=tied,
    )


def _model_file(src, view, blocks, shapes, stage, dp, ep, rank) -> dict:
    states = _model_states(view, stage, dp, _frozen_fragments(view, stage, dp, rank))
    aliases = {f"{b.path}.{names_.ROUTER_ALIAS}" for b in blocks}
    if stage > 0:  # (the router's alias is no shared parameter to DeepSpeed)
        states["shared_params"] = {k: v for k, v in view.tied.items() if not any(k.startswith(a) for a in aliases)}
    states["ds_config"] = _autoep_ds_config(view, stage, ep)
    info = dict(states.pop("universal_checkpoint_info", None) or {})
    layers = autoep_layers(blocks, shapes, ep, dp, rank, stage)
    states["num_experts"] = [b.experts for b in blocks]
    states["ds_autoep_layers"] = layers
    info.setdefault("universal_checkpoint_version", UNIVERSAL_VERSION)
    info.update(expert_parameter_patterns=list(EXPERT_PATTERNS), ds_autoep_layers=layers)
    states["universal_checkpoint_info"] = info
    return states


def _autoep_ds_config(view: ExportSource, stage: int, ep: int) -> dict:
    """The saved config as DeepSpeed's AutoEP run at ZeRO `stage` and `autoep_size` `ep` records it."""
    cfg = _ds_config(view, stage)
    cfg["expert_parallel"] = {**(cfg.get("expert_parallel") or {}), "autoep_size": ep}
    return cfg


def _stage3_file(view: ExportSource, moe: list[bool], dp: int, ep: int, rank: int, sub_group_size: int) -> dict:
    """Rank `rank`'s ZeRO-3 optimizer state: dense groups cut over the dp ranks, expert groups over the rank's
    expert-data-parallel ranks, and DeepSpeed's `ds_zero_partition_groups` record of that placement."""
    dense = _stage3_optim(view, dp, rank, sub_group_size)
    experts = _stage3_optim(view, dp // ep, rank // ep, sub_group_size)
    if len(dense["fp32_flat_groups"]) != len(view.group_names):
        raise CheckpointError(
            f"export to DeepSpeed's AutoEP at ZeRO 3: zero_optimization.sub_group_size {sub_group_size} cuts a param "
            "group into several sub-groups, which is not written; export with a larger --sub-group-size"
        )
    pick = [experts if m else dense for m in moe]
    groups = []
    for gi, m in enumerate(moe):
        ranks = [rank % ep + k * ep for k in range(dp // ep)] if m else list(range(dp))
        family = "autoep_expert" if m else "replicated"
        groups.append(
            {
                "sub_group": gi,
                "partition_count": len(ranks),
                "partition_rank": ranks.index(rank),
                "partition_ranks": ranks,
                "families": [family],
                "group_names": [f"ep_size_{ep}" if m else "replicated"],
            }
        )
    state = dense["optimizer_state_dict"]
    return {
        "zero_stage": dense["zero_stage"],
        "loss_scaler": dense["loss_scaler"],
        "dynamic_loss_scale": dense["dynamic_loss_scale"],
        "overflow": dense["overflow"],
        "partition_count": dp,
        "ds_zero_partition_groups": groups,
        "optimizer_state_dict": {
            "state": {gi: p["optimizer_state_dict"]["state"][gi] for gi, p in enumerate(pick)},
            "param_groups": state["param_groups"],
        },
        "fp32_flat_groups": [p["fp32_flat_groups"][gi] for gi, p in enumerate(pick)],
    }


def _check(src: ExportSource, blocks: list[Block], stage: int, dp: int, ep: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"export to DeepSpeed: stage must be 0-3, got {stage}")
    if src.param_dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(
            f"export of an AutoEP checkpoint to DeepSpeed with {src.param_dtype} weights: only fp32 and bf16 runs "
            "are written (DeepSpeed 0.19.8 builds no fp16 AutoEP run on CPU to check one against)"
        )
    if stage == 0 and src.param_dtype != torch.float32:
        raise CheckpointError(
            f"export of an AutoEP checkpoint to DeepSpeed at ZeRO stage 0 with {src.param_dtype} weights: DeepSpeed "
            "keeps those in its FP16_Optimizer / BF16_Optimizer, whose AutoEP layout is not written; export at "
            "stage 1, 2 or 3"
        )
    if stage == 1 and src.param_dtype == torch.bfloat16 and _uses_bf16_optimizer(src):
        raise CheckpointError(
            "export of a bf16 AutoEP checkpoint to DeepSpeed at ZeRO stage 1 with data_types.grad_accum_dtype fp32: "
            "DeepSpeed trains that with its BF16_Optimizer, whose AutoEP layout is not written; export at stage 2 "
            "or 3, or drop grad_accum_dtype from the saved config"
        )
    if not blocks:
        raise CheckpointError("export to DeepSpeed's AutoEP: the checkpoint holds no stacked experts (gate_up_proj)")
    if ep < 1 or dp % ep or any(b.experts % ep for b in blocks):
        raise CheckpointError(
            f"export to DeepSpeed's AutoEP at ep {ep}: it must divide the data-parallel size {dp} and every block's "
            f"experts {[b.experts for b in blocks]}; pass another --ep"
        )
    ds_config = src.meta.get("ds_config") or {}
    if ds_config.get("use_data_before_expert_parallel_") or ds_config.get("use_data_before_expert_parallelism"):
        raise CheckpointError(
            "export to DeepSpeed's AutoEP: the run set use_data_before_expert_parallel_, which orders DeepSpeed's "
            "expert-data-parallel groups otherwise; only the default order (rank r at ep rank r % ep) is written"
        )
    frozen = [k for k in src.module if any(k.startswith(b.prefix + ".") for b in blocks)]
    if frozen:
        raise CheckpointError(
            f"export to DeepSpeed's AutoEP: frozen expert weights or buffers ({frozen[:3]}) are not written"
        )


def write_deepspeed_autoep_tag(
    src: ExportSource, out_dir, tag: str, *, stage: int, dp: int, ep: int, sub_group_size: int | None = None
) -> Path:
    """Write an AutoEP checkpoint's source (transformers' names, experts whole) as DeepSpeed 0.19.8's AutoEP tag
    `out_dir/tag` for ZeRO `stage` (0-3) on `dp` ranks at `autoep_size` `ep` (Note [DeepSpeed AutoEP export]), and
    point `out_dir/latest` at it. Returns the tag directory."""
    blocks = autoep_blocks(src)
    _check(src, blocks, stage, dp, ep)
    moe = _expert_groups(src, blocks)
    views = [ep_view(src, blocks, moe, ep, e) for e in range(ep)]
    shapes = {}
    for b in blocks:
        gate_up = src.universal.tensors[f"{b.prefix}.{names_.GATE_UP}"][FP32].shape
        down = src.universal.tensors[f"{b.prefix}.{names_.DOWN}"][FP32].shape
        half = [gate_up[0], gate_up[1] // 2, *gate_up[2:]]
        shapes.update({f"{b.prefix}.w1": half, f"{b.prefix}.w2": list(down), f"{b.prefix}.w3": half})
    root, staging, sub_group_size = stage_tag(src, out_dir, tag, sub_group_size)
    for r in range(dp if stage == 3 else 1):
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else MODEL
        _save(_model_file(src, views[r % ep], blocks, shapes, stage, dp, ep, r), staging / name)
    if stage < 3:
        for i, b in enumerate(blocks):
            for g in range(b.experts):
                e, j = divmod(g, b.experts // ep)
                view = views[e]
                expert = OrderedDict(
                    (f"{b.prefix}.{w}.{g}", _weight(view, f"{b.prefix}.{w}")[j].clone()) for w in names_.EXPERT_WEIGHTS
                )
                _save(expert, staging / f"layer_{i}_expert_{g}_mp_rank_00_model_states.pt")
    for e, view in enumerate(views if stage == 0 else []):  # ZeRO 0: each ep rank's torch optimizer state
        _save({"optimizer": _stage0_optimizer(view)}, staging / expp_file(e))
    prefix = BF16_PREFIX if src.param_dtype == torch.bfloat16 else ""  # (DeepSpeed's bf16 run's optimizer files)
    for r in range(dp if stage > 0 else 0):
        view = views[r % ep]
        if stage == 3:
            osd = _stage3_file(view, moe, dp, ep, r, sub_group_size)
        else:
            osd = _splice(_stage12_optim(view, stage, dp, r), _stage12_optim(view, stage, dp // ep, r // ep), moe)
        _save(
            {
                "optimizer_state_dict": osd,
                "ds_config": _autoep_ds_config(view, stage, ep),
                "ds_version": DS_LAYOUT_VERSION,
            },
            staging / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )
    return publish_tag(root, staging, tag)


def is_autoep_checkpoint(checkpoint_dir, tag: str | None = None) -> bool:
    """Whether a zerospeed checkpoint was saved under AutoEP (its config's `expert_parallel` enabled, stacked experts
    among its parameters)."""
    tag_dir, manifest = resolve_checkpoint(checkpoint_dir, tag)
    if not any(n.endswith(f".experts.{names_.GATE_UP}") for n in manifest["parameters"]):
        return False
    states = torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
    return autoep_settings(states.get("ds_config")) is not None


def export_autoep_to_deepspeed(
    checkpoint_dir,
    output_dir,
    *,
    stage: int,
    dp: int,
    ep: int | None = None,
    tag: str | None = None,
    output_tag: str | None = None,
    sub_group_size: int | None = None,
) -> Path:
    """Export a zerospeed AutoEP checkpoint as DeepSpeed 0.19.8's AutoEP tag for ZeRO `stage` on `dp` ranks at
    `autoep_size` `ep` (default: the saved config's), with `latest` (`write_deepspeed_autoep_tag`)."""
    tag_dir, _ = resolve_checkpoint(checkpoint_dir, tag)
    src = read_zerospeed_source(checkpoint_dir, tag)
    if ep is None:
        ep = int((autoep_settings(src.meta.get("ds_config")) or {}).get("autoep_size") or 1)
    return write_deepspeed_autoep_tag(
        src, output_dir, output_tag or tag_dir.name, stage=stage, dp=dp, ep=ep, sub_group_size=sub_group_size
    )
