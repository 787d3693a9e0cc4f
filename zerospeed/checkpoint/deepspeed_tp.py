"""Reading a tensor-parallel checkpoint DeepSpeed saved (AutoTP, `tensor_parallel.autotp_size`).

Note [DeepSpeed tensor-parallel checkpoints]: with AutoTP at tp degree T and dp D, DeepSpeed 0.19.8 writes
per tp rank t `mp_rank_{t:02d}_model_states.pt` (its module state dict holds rank t's *local* shards; at
ZeRO 0 also the torch optimizer's `state_dict()` over those local tensors; `mp_world_size` T) and at
ZeRO 1/2 per (dp rank d, tp rank t) `zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt` — each tp rank's
files are a data-parallel checkpoint of its own local tensors (Note [DeepSpeed checkpoints] in
deepspeed_import.py). AutoTP stops at ZeRO 2. How the local tensors make the full one is recorded in every
model-states file as `universal_checkpoint_info` (what DeepSpeed's `ds_to_universal` reads):
- `affine_map` (format version 1): per parameter-name pattern, per tp rank, the pieces of its local tensor,
  each a `torch.as_strided` view of the full tensor ("source": offset, strides) and of the local one
  ("dest"), with the ranks holding it and a `scale` (local == full * scale); Adam's moments carry scale^-1
  and scale^-2 (`SCALE_POWER`);
- else the name categories: `tp_replicated_parameter_patterns` (rank 0's copy),
  `parameter_to_average_patterns` (the mean), `parameter_with_row_parallelism_patterns` (concatenated
  along dim 1), `vocabulary_parameter_patterns` (along dim 0, cut to `original_vocab_size`),
  `parameter_with_2_sub_params_cat_dim_0` (each rank's two halves concatenated half by half), anything
  else along dim 0. Fused sub-parameters without an affine map (`parameter_with_sub_params`) are refused.
The full tensors are the plain model's (an nn.Linear's [out, in]), which is zerospeed's canonical form
(Note [canonical tensors] in tensor_parallel.py), so the result is the same `DeepSpeedCheckpoint` a
data-parallel tag gives, and the engine cuts its own tp pieces from it at any tp degree.
A checkpoint of a Megatron-style mpu run records no such information unless the model sets
`universal_checkpoint_info` (Megatron-DeepSpeed does): without it it is refused with the fix, with it it loads (also
into the run's own hand-split model: Note [DeepSpeed mpu tensor-parallel checkpoints] in deepspeed_mpu_tp.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_import import (
    MODEL,
    DeepSpeedCheckpoint,
    _load,
    _read_stage0,
    _read_stage12,
    describe,
    is_universal_folder,
    optim_prefix,
    param_shapes,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32, UniversalState

SCALE_POWER = {FP32: 1, "exp_avg": -1, "exp_avg_sq": -2}  # how a piece's scale applies to each state
AFFINE_VERSION = 1  # the affine-map format this reader understands


def model_file(tp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def is_deepspeed_tp_tag(tag_dir: Path) -> bool:
    """A DeepSpeed tag saved with tensor parallelism (a second tp rank's files), other than a universal folder
    (whose tensors are full: deepspeed_import reads it)."""
    return any(Path(tag_dir).glob("*mp_rank_01_*")) and not is_universal_folder(tag_dir)


def read_deepspeed_tp_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form (full canonical tensors) of a DeepSpeed tensor-parallel tag, as
    `deepspeed_import.read_deepspeed_checkpoint` gives for a data-parallel one."""
    tag_dir = Path(tag_dir)
    if not (tag_dir / MODEL).is_file():
        raise CheckpointError(
            f"{tag_dir}: no {MODEL}; a tensor-parallel DeepSpeed checkpoint at ZeRO 3 (or one with pipeline "
            "stages) is not read here: DeepSpeed's AutoTP trains at ZeRO 0-2"
        )
    first = _load(tag_dir / MODEL)
    tp = int(first.get("mp_world_size") or 1)
    info = _uc_info(tag_dir, first)
    if any(tag_dir.glob("layer_*")) or any(tag_dir.glob("*expp_rank*")):
        raise CheckpointError(
            f"{tag_dir}: a tensor-parallel DeepSpeed checkpoint with pipeline stages or MoE experts is not read by a "
            "data-parallel engine; a pipeline one loads into a PipelineModule's engine (zerospeed.pipe; "
            "deepspeed_pipeline_tp.py), a MoE one: convert it with DeepSpeed's ds_to_universal.py and zero_to_fp32"
        )
    ranks = [
        _read_rank(tag_dir, t, first if t == 0 else _load(tag_dir / model_file(t)), names, group_names)
        for t in range(tp)
    ]
    shapes = [ckpt.layout["shapes"] for ckpt in ranks]
    uni = UniversalState()
    full_shapes: dict[str, tuple[int, ...]] = {}
    for name, keys in ranks[0].universal.tensors.items():
        local = [shapes[t][name] for t in range(tp)]
        joined = {}
        for key in keys:
            parts = [ranks[t].universal.tensors[name][key].view(local[t]) for t in range(tp)]
            joined[key] = join(info, name, parts, key, tag_dir)
        full_shapes[name] = tuple(joined[FP32].shape)
        uni.tensors[name] = {k: v.reshape(-1) for k, v in joined.items()}
        uni.scalars[name], uni.groups[name] = ranks[0].universal.scalars[name], ranks[0].universal.groups[name]
    buffers = set(ranks[0].layout["buffer_names"])  # (not split: DeepSpeed's AutoTP splits parameters only)
    module = {
        k: join(info, k, [r.module[k] for r in ranks], FP32, tag_dir) if k not in buffers else v
        for k, v in ranks[0].module.items()
    }
    out = ranks[0]
    out.tag_dir, out.universal, out.module = tag_dir, uni, module
    out.layout["shapes"] = {
        n: full_shapes.get(n, tuple(module[n].shape) if n in module else s) for n, s in out.layout["shapes"].items()
    }
    out.meta["tp"] = tp
    return out


def _uc_info(tag_dir: Path, model: dict) -> dict:
    info = model.get("universal_checkpoint_info")
    if not info:
        raise CheckpointError(
            f"{tag_dir / MODEL}: a tensor-parallel DeepSpeed checkpoint (mp_world_size {model.get('mp_world_size')}) "
            "without universal_checkpoint_info, so which parameters are split how is not recorded (a Megatron-style "
            "mpu run); set model.universal_checkpoint_info in the DeepSpeed run (as AutoTP does), or convert it "
            "with DeepSpeed's zero_to_fp32.py per tp rank and load the weights"
        )
    version = (info.get("affine_map") or {}).get("version", AFFINE_VERSION)
    if version > AFFINE_VERSION:
        raise CheckpointError(
            f"{tag_dir / MODEL}: its universal_checkpoint_info has affine map version {version}; "
            f"this reader knows version {AFFINE_VERSION}"
        )
    return info


def _read_rank(tag_dir: Path, t: int, model: dict, names, group_names) -> DeepSpeedCheckpoint:
    """Tp rank t's files as a data-parallel DeepSpeed checkpoint of its local tensors."""
    dp = int(model.get("dp_world_size") or 1)
    shapes = param_shapes(tag_dir, model, group_names)
    if model.get("optimizer") is not None or optim_prefix(tag_dir) is None:
        ckpt = _read_stage0(tag_dir, model, shapes, names)
    else:
        ckpt = _read_stage12(tag_dir, model, dp, shapes, names, mp_rank=t)
    ckpt = describe(ckpt, model, shapes)
    ckpt.client_state.pop("universal_checkpoint_info", None)
    return ckpt


def _matches(patterns, name: str) -> bool:
    return any(re.match(p, name) for p in patterns or ())


def join(info: dict, name: str, parts: list[torch.Tensor], key: str, where: Path) -> torch.Tensor:
    """The full tensor of `name`'s state `key` from the tp ranks' local tensors `parts` (Note [DeepSpeed
    tensor-parallel checkpoints])."""
    affine = info.get("affine_map") or {}
    maps = [p for p in (affine.get("params") or {}) if re.match(p, name)]
    if maps:
        return _rebuild(affine["params"][maps[0]], parts, key, name, where)
    if _matches(info.get("tp_replicated_parameter_patterns"), name):
        return parts[0]
    if _matches(info.get("parameter_to_average_patterns"), name):
        return sum(parts) / len(parts)
    if _matches(info.get("parameter_with_row_parallelism_patterns"), name):
        return torch.cat(parts, dim=1)
    if _matches(info.get("parameter_with_2_sub_params_cat_dim_0"), name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    subs = [s for s in info.get("parameter_with_sub_params") or () if _matches(_sub_patterns(s), name)]
    if subs:
        raise CheckpointError(
            f"{where}: {name} is a fused parameter of sub-parameters without an affine map in "
            "universal_checkpoint_info; it is not read here (save it with DeepSpeed >= 0.19.8's AutoTP)"
        )
    full = torch.cat(parts, dim=0)
    if _matches(info.get("vocabulary_parameter_patterns"), name) and info.get("original_vocab_size"):
        full = full[: int(info["original_vocab_size"])]
    return full


def _sub_patterns(spec) -> list[str]:
    return list(spec.get("patterns", ())) if isinstance(spec, dict) else list(getattr(spec, "patterns", ()))


def _rebuild(param_map: dict, parts: list[torch.Tensor], key: str, name: str, where: Path) -> torch.Tensor:
    """The full tensor from an affine map: every piece's local view, unscaled, copied into its full view."""
    shape = [int(d) for d in param_map["logical_shape"]]
    full = torch.zeros(shape, dtype=parts[0].dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for rank, entry in param_map["ranks"].items():
        local = parts[int(rank)].contiguous()
        if list(local.shape) != [int(d) for d in entry["shard_shape"]]:
            raise CheckpointError(
                f"{where}: tp rank {rank}'s {name} has shape {list(local.shape)}, its affine map says "
                f"{list(entry['shard_shape'])}"
            )
        for piece in entry["pieces"]:
            size = [int(d) for d in piece["shape"]]
            (src_off, src_strides), (dst_off, dst_strides) = piece["source"], piece["dest"]
            value = local.as_strided(size, dst_strides, dst_off)
            scale = float(piece.get("scale", 1.0))
            if scale != 1.0:
                if key not in SCALE_POWER:
                    raise CheckpointError(
                        f"{where}: {name} is stored scaled by {scale}; its optimizer state {key!r} has no known rule"
                    )
                value = value / scale ** SCALE_POWER[key]
            full.as_strided(size, src_strides, src_off).copy_(value)
            covered.as_strided(size, src_strides, src_off).fill_(True)
    if not bool(covered.all()):
        raise CheckpointError(
            f"{where}: the tp ranks' pieces of {name} leave {int((~covered).sum())} of {math.prod(shape)} elements "
            "uncovered (its affine map is incomplete)"
        )
    return full
