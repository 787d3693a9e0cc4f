"""Writing a checkpoint in DeepSpeed 0.19.8's own layout, so that the real DeepSpeed resumes it.

`export_to_deepspeed(src, out, stage=S, dp=N)` reads a zerospeed checkpoint (any stage, data- and
tensor-parallel size) into its universal form (full fp32 masters and elementwise optimizer states per
parameter) and cuts that into the files DeepSpeed's `engine.load_checkpoint` reads at ZeRO stage S on N
data-parallel ranks (Note [DeepSpeed checkpoints] in deepspeed_import.py names them). The same writer
turns a DeepSpeed checkpoint into one for another stage or dp (`source_from_deepspeed`).

Note [DeepSpeed's partitions]: what DeepSpeed's loader requires of the files, from its 0.19.8 source:
- ZeRO 1/2: per param group, the trainable parameters flattened in group order, the flat length
  rounded up to a multiple of 2 * dp (`nccl_start_alignment_factor`), split into dp equal partitions.
  A rank's `single_partition_of_fp32_groups` holds its partition without the trailing padding (the
  padding sits in the last partitions: `group_paddings`); its `base_optimizer_state` is the torch
  optimizer's `state_dict()` over one flat tensor per group, padded, which the loader hands straight to
  `torch.optim.Optimizer.load_state_dict` (so its shapes must be the partition's). `param_alignment_paddings`
  must equal the loader's (zeros unless `parameter_alignment`); `param_slice_mappings` (read by
  `ds_to_universal` and zerospeed) gives each parameter fragment's (numel, start) in the partition.
- ZeRO 3: every parameter is split alone: ceil(numel / dp) elements per rank, the last rank's padded.
  A param group is cut into sub-groups of at least `sub_group_size` partition elements (the last one takes
  the rest); a rank's `fp32_flat_groups` holds one flat tensor per sub-group (its parameters' partitions
  in order) and the optimizer state is indexed by sub-group. The model states, one file per rank, hold
  the buffers and empty placeholders for the parameters (frozen ones' partitions in `frozen_param_fragments`).
- ZeRO 0: one model-states file with the module's weights and the torch optimizer's `state_dict()`.
- bf16: the optimizer files are `bf16_zero_pp_rank_*` (DeepSpeed's loader under bf16 looks only for those).
  At ZeRO 1 with `data_types.grad_accum_dtype` fp32 in the recorded config (and no optimizer offload),
  DeepSpeed trains with its `BF16_Optimizer` and loads only that one's state (Note [DeepSpeed's bf16 files] in
  deepspeed_import.py): the partitions whole (padding included), padding recorded on the last rank only.
  Otherwise (DeepSpeed's default accumulates bf16 in bf16) ZeRO 1 is its ZeRO optimizer's layout.
- The loss scaler, `zero_stage` and fragment addresses are DeepSpeed objects
  (Note [DeepSpeed's pickled classes]); `ds_version` must parse as a version; `latest` names the tag.
The written tag also reads in DeepSpeed's `zero_to_fp32.py` and `ds_to_universal.py` (its model states
carry `universal_checkpoint_info`, which the converter requires).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerospeed.checkpoint.atomic import fresh_dir, swap_in_dir
from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.deepspeed_import import BF16_PREFIX, DeepSpeedCheckpoint
from zerospeed.checkpoint.deepspeed_pickle import PICKLE_MODULE, fragment_address, loss_scaler, zero_stage
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.manifest import verify_files
from zerospeed.checkpoint.module_state import SavedModule
from zerospeed.checkpoint.naming import MODEL_STATES, UNIVERSAL_INFO
from zerospeed.checkpoint.state import RESERVED_KEYS
from zerospeed.checkpoint.universal import FP32, UniversalState, load_universal
from zerospeed.utils.files import atomic_write, atomic_write_text

DS_LAYOUT_VERSION = "0.19.8"  # the DeepSpeed release whose layout is written (its loader parses this)
NCCL_START_ALIGNMENT = 2  # DeepSpeed's `nccl_start_alignment_factor` (ZeRO 1/2 group alignment: 2 * dp)
GRADIENT_CLIPPING_DEFAULT = 1.0  # DeepSpeed 0.19.8's default (its loader takes the checkpoint's value)
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size's default


@dataclass
class ExportSource:
    """A checkpoint's content independent of its layout: what a DeepSpeed tag of any stage and dp holds."""

    universal: UniversalState  # every trainable parameter's full fp32 master and elementwise optimizer states
    group_names: list[list[str]]  # the trainable parameters per optimizer param group, in the group's order
    param_groups: list[dict]  # the optimizer's hyperparameters per group (without "params")
    module: dict[str, torch.Tensor]  # buffers and frozen parameters, full
    module_keys: list[str]  # the module's state-dict keys in order (tied aliases included)
    buffer_names: list[str]
    tied: dict[str, str]  # alias -> first name
    param_dtype: torch.dtype
    meta: dict = field(default_factory=dict)  # counters, lr_scheduler, data_sampler, ds_config, loss_scaler
    client_state: dict = field(default_factory=dict)

    def frozen_names(self) -> list[str]:
        trainable = {n for g in self.group_names for n in g}
        buffers = set(self.buffer_names)
        return [k for k in self.module_keys if k not in buffers and k not in trainable and k not in self.tied]


# ---- pure partition math (Note [DeepSpeed's partitions]) ----


def stage12_partition(numel: int, dp: int) -> tuple[int, list[int]]:
    """(partition size, padding of each rank's partition) of a ZeRO-1/2 param group of `numel` elements."""
    alignment = NCCL_START_ALIGNMENT * dp
    size = math.ceil(numel / alignment) * alignment // dp
    return size, [min(size, max(0, (r + 1) * size - numel)) for r in range(dp)]


def stage3_partition(numel: int, dp: int) -> int:
    """Elements of one parameter on each rank at ZeRO 3 (the last rank's padded)."""
    return math.ceil(numel / dp)


def sub_groups(partition_numels: list[int], sub_group_size: int) -> list[list[int]]:
    """Indices of a ZeRO-3 param group's parameters per sub-group (`partition_numels`: each one's
    elements per rank): a sub-group closes when it reaches `sub_group_size` elements or at the last one."""
    if sub_group_size >= sum(partition_numels):
        return [list(range(len(partition_numels)))] if partition_numels else []
    out, current, filled = [], [], 0
    for i, n in enumerate(partition_numels):
        current.append(i)
        filled += n
        if filled >= sub_group_size or i == len(partition_numels) - 1:
            out.append(current)
            current, filled = [], 0
    return out


def slice_mappings(numels: list[int], names: list[str], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """(name, numel, start in the partition) of each parameter fragment in the flat range [lo, hi)."""
    out, offset = [], 0
    for name, n in zip(names, numels):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append((name, b - a, a - lo))
        offset += n
    return out


# ---- sources ----


def read_zerospeed_source(checkpoint_dir, tag: str | None = None, group_names=None) -> ExportSource:
    """The export source of a zerospeed checkpoint (every file verified against its manifest first).
    `group_names`: the trainable parameters per optimizer param group in the order the groups list them;
    by default each group's parameters in module order (the order `model.parameters()` gives)."""
    tag_dir, manifest = resolve_checkpoint(checkpoint_dir, tag)
    if (problem := verify_files(tag_dir, manifest, list(manifest["files"]))) is not None:
        raise CheckpointError(problem)
    uni = load_universal(tag_dir, manifest)
    states = torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
    saved = SavedModule(tag_dir, manifest, states)
    specs, tied = manifest["parameters"], manifest.get("tied", {})
    hyper = states.get("optimizer_param_groups") or [{}]
    if group_names is None:
        group_names = [[] for _ in hyper]
        for name, spec in specs.items():
            if spec["trainable"]:
                group_names[max(uni.groups.get(name, 0), 0)].append(name)
    trainable = {n for g in group_names for n in g}
    module = {k: saved.full(k) for k in saved.keys() if tied.get(k, k) not in trainable and k not in tied}
    from_states = ("lr_scheduler", "data_sampler", "random_ltd", "global_steps", "global_samples", "skipped_steps")
    meta = {k: states.get(k) for k in from_states}
    meta.update(ds_config=states.get("ds_config") or {}, loss_scaler=states.get("loss_scaler"))
    return ExportSource(
        universal=uni,
        group_names=group_names,
        param_groups=list(hyper),
        module=module,
        module_keys=list(manifest["module_keys"]),
        buffer_names=list(states.get("buffer_names") or []),
        tied=dict(tied),
        param_dtype=getattr(torch, manifest.get("param_dtype", "float32")),
        meta=meta,
        client_state=_client_state(states),
    )


def _client_state(states: dict) -> dict:
    return {k: v for k, v in states.items() if k not in RESERVED_KEYS}


def source_from_deepspeed(ckpt: DeepSpeedCheckpoint) -> ExportSource:
    """The export source of a checkpoint DeepSpeed saved (read by `read_deepspeed_checkpoint`)."""
    keys = ckpt.layout.get("module_keys") or list(ckpt.module)
    tied = dict(ckpt.layout.get("shared_params") or {})
    trainable = {n for g in ckpt.layout["group_names"] for n in g}
    module = {k: v for k, v in ckpt.module.items() if k not in trainable and k not in tied}
    loss = ckpt.meta.get("loss_scaler")
    ds_config = ckpt.meta.get("ds_config") or {}
    dtype = torch.float16 if _enabled(ds_config, "fp16") else torch.bfloat16 if _enabled(ds_config, "bf16") else None
    shapes = ckpt.layout["shapes"]
    uni = UniversalState(
        {n: {k: v.view(shapes[n]) for k, v in t.items()} for n, t in ckpt.universal.tensors.items()},
        ckpt.universal.scalars,
        ckpt.universal.groups,
    )
    return ExportSource(
        universal=uni,
        group_names=ckpt.layout["group_names"],
        param_groups=ckpt.param_groups,
        module=module,
        module_keys=keys,
        buffer_names=list(ckpt.layout.get("buffer_names") or []),
        tied=tied,
        param_dtype=dtype or torch.float32,
        meta={**ckpt.meta, "loss_scaler": loss},
        client_state=dict(ckpt.client_state),
    )


def _enabled(ds_config: dict, key: str) -> bool:
    block = ds_config.get(key) or ds_config.get("bfloat16" if key == "bf16" else key) or {}
    return bool(block.get("enabled")) if isinstance(block, dict) else False


# ---- the files ----


def _scaler(src: ExportSource) -> object:
    """DeepSpeed's loss scaler for the checkpoint: dynamic with fp16 (zerospeed's scaler state, the rest
    of DeepSpeed's attributes from the fp16 config block and its defaults), else static at 1."""
    saved = src.meta.get("loss_scaler") or {}
    if not saved.get("dynamic"):
        return loss_scaler({"cur_scale": float(saved.get("scale", 1.0)), "dynamic": False})
    fp16 = src.meta.get("ds_config", {}).get("fp16") or {}
    hysteresis = int(fp16.get("hysteresis", 2))
    return loss_scaler(
        {
            "cur_scale": float(saved["scale"]),
            "cur_iter": int(saved.get("cur_iter", 0)),
            "last_overflow_iter": int(saved.get("last_overflow_iter", -1)),
            "scale_factor": 2.0,
            "scale_window": int(fp16.get("loss_scale_window", 1000)),
            "min_scale": float(fp16.get("min_loss_scale", 1)),
            "delayed_shift": hysteresis,
            "cur_hysteresis": int(saved.get("cur_hysteresis", hysteresis)),
            "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
            "raise_error_at_min_scale": True,
            "dynamic": True,
            "dtype": src.param_dtype,
        }
    )


def _ds_config(src: ExportSource, stage: int) -> dict:
    cfg = copy.deepcopy(src.meta.get("ds_config") or {})
    cfg.setdefault("zero_optimization", {})
    if isinstance(cfg["zero_optimization"], dict):
        cfg["zero_optimization"]["stage"] = stage
    return cfg


def _weight(src: ExportSource, name: str) -> torch.Tensor:
    return src.universal.tensors[name][FP32].to(src.param_dtype)


def _model_states(src: ExportSource, stage: int, dp: int, frozen_fragments=None) -> dict:
    trainable = {n for g in src.group_names for n in g}
    frozen = src.frozen_names()
    module: dict[str, torch.Tensor] = OrderedDict()
    for key in src.module_keys:
        name = src.tied.get(key, key)
        if name in trainable:
            value = torch.empty(0, dtype=src.param_dtype) if stage == 3 else _weight(src, name)
        elif name in src.module:
            value = src.module[name]
            if stage == 3 and name in frozen:
                value = torch.empty(0, dtype=value.dtype)
        else:
            continue  # a frozen parameter the checkpoint was saved without
        module[key] = module[name] if name != key and name in module else value
    shapes = [OrderedDict((n, src.universal.tensors[n][FP32].shape) for n in g) for g in src.group_names]
    states = {
        "module": module,
        "buffer_names": list(src.buffer_names),
        "optimizer": _stage0_optimizer(src) if stage == 0 else None,
        "param_shapes": shapes if stage > 0 else None,
        # DeepSpeed records frozen parameters from ZeRO 2 on (whole at stage 2, this rank's partition at 3)
        "frozen_param_shapes": OrderedDict((n, src.module[n].shape) for n in frozen if n in src.module)
        if stage >= 2
        else None,
        "shared_params": dict(src.tied) if stage > 0 else None,
        "frozen_param_fragments": frozen_fragments if stage >= 2 else None,
        "lr_scheduler": src.meta.get("lr_scheduler"),
        "data_sampler": src.meta.get("data_sampler"),
        "random_ltd": src.meta.get("random_ltd"),
        "skipped_steps": int(src.meta.get("skipped_steps") or 0),
        "global_steps": int(src.meta.get("global_steps") or 0),
        "global_samples": int(src.meta.get("global_samples") or 0),
        "dp_world_size": dp,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _ds_config(src, stage),
        "ds_version": DS_LAYOUT_VERSION,
    }
    states.update(src.client_state)
    states.setdefault("universal_checkpoint_info", dict(UNIVERSAL_INFO))
    return states


def _group_state(src: ExportSource, names: list[str], lo: int, hi: int, size: int) -> dict:
    """The optimizer state of one flat tensor holding elements [lo, hi) of the concatenation of `names`'
    states, zero-padded to `size` elements."""
    if not names:
        return {}
    keys = sorted(set.intersection(*(set(src.universal.tensors[n]) for n in names)) - {FP32})
    out = {k: _own(v) for k, v in src.universal.scalars.get(names[0], {}).items()}
    for key in keys:
        out[key] = _flat_slice(src, names, key, lo, hi, size)
    return out


def _own(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


def _flat_slice(src: ExportSource, names: list[str], key: str, lo: int, hi: int, size: int) -> torch.Tensor:
    """Elements [lo, hi) of the concatenation of `names`' `key` tensors, zero-padded to `size`."""
    tensors = [src.universal.tensors[n][key].reshape(-1) for n in names]
    out = torch.zeros(size, dtype=tensors[0].dtype)
    offset = 0
    for t in tensors:
        a, b = max(lo, offset), min(hi, offset + t.numel())
        if a < b:
            out[a - lo : b - lo].copy_(t[a - offset : b - offset])
        offset += t.numel()
    return out


def _hyper(src: ExportSource, gi: int, params: list[int]) -> dict:
    group = {k: copy.deepcopy(v) for k, v in src.param_groups[gi].items() if k != "params"}
    return {**group, "params": params}


def _stage0_optimizer(src: ExportSource) -> dict:
    state, groups, index = {}, [], 0
    for gi, names in enumerate(src.group_names):
        params = []
        for name in names:
            tensors = src.universal.tensors[name]
            shape = tensors[FP32].shape
            st = {k: _own(v) for k, v in src.universal.scalars.get(name, {}).items()}
            st.update({k: v.reshape(shape).clone() for k, v in tensors.items() if k != FP32})
            if len(st):
                state[index] = st
            params.append(index)
            index += 1
        groups.append(_hyper(src, gi, params))
    return {"state": state, "param_groups": groups}


def _stage12_optim(src: ExportSource, stage: int, dp: int, rank: int) -> dict:
    fp32, states, paddings, counts, mappings, groups = [], {}, [], [], [], []
    for gi, names in enumerate(src.group_names):
        numels = [src.universal.tensors[n][FP32].numel() for n in names]
        size, pads = stage12_partition(sum(numels), dp)
        lo = rank * size
        fp32.append(_flat_slice(src, names, FP32, lo, lo + size, size)[: size - pads[rank]])
        if state := _group_state(src, names, lo, lo + size, size):
            states[gi] = state
        paddings.append(pads[rank])
        counts.append(dp)
        mappings.append(
            OrderedDict((n, fragment_address(k, s)) for n, k, s in slice_mappings(numels, names, lo, lo + size))
        )
        groups.append(_hyper(src, gi, [gi]))
    return {
        "loss_scaler": _scaler(src),
        "dynamic_loss_scale": bool((src.meta.get("loss_scaler") or {}).get("dynamic")),
        "overflow": False,
        "clip_grad": float((src.meta.get("ds_config") or {}).get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)),
        "base_optimizer_state": {"state": states, "param_groups": groups},
        "single_partition_of_fp32_groups": fp32,
        "zero_stage": zero_stage(stage),
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(names) for names in src.group_names],
        "partition_count": counts,
        "ds_version": DS_LAYOUT_VERSION,
        "param_slice_mappings": mappings,
    }


def _bf16_optimizer_optim(src: ExportSource, dp: int, rank: int) -> dict:
    """DeepSpeed's BF16_Optimizer state of rank `rank` (bf16 at ZeRO 1; Note [DeepSpeed's bf16 files])."""
    zero = _stage12_optim(src, 1, dp, rank)
    fp32, paddings = [], []
    for names in src.group_names:
        numels = [src.universal.tensors[n][FP32].numel() for n in names]
        size, _ = stage12_partition(sum(numels), dp)
        fp32.append(_flat_slice(src, names, FP32, rank * size, (rank + 1) * size, size))
        paddings.append(size * dp - sum(numels) if rank == dp - 1 else 0)
    return {
        "clip_grad": zero["clip_grad"],
        "base_optimizer_state": zero["base_optimizer_state"],
        "single_partition_of_fp32_groups": fp32,
        "group_paddings": paddings,
        "partition_count": zero["partition_count"],
        "ds_version": DS_LAYOUT_VERSION,
        "param_slice_mappings": zero["param_slice_mappings"],
    }


def _uses_bf16_optimizer(src: ExportSource) -> bool:
    """Whether DeepSpeed 0.19.8 trains this bf16 run at ZeRO 1 with its BF16_Optimizer: when the gradients
    accumulate in fp32 (its default is the model's dtype) and the optimizer is not offloaded."""
    cfg = src.meta.get("ds_config") or {}
    accumulate = str((cfg.get("data_types") or {}).get("grad_accum_dtype") or "bf16").lower()
    offload = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return accumulate in ("fp32", "float32", "float") and str(offload).lower() in ("none", "null")


def _stage3_optim(src: ExportSource, dp: int, rank: int, sub_group_size: int) -> dict:
    flats, states, groups, index = [], {}, [], 0
    for gi, names in enumerate(src.group_names):
        parts = [stage3_partition(src.universal.tensors[n][FP32].numel(), dp) for n in names]
        params = []
        for members in sub_groups(parts, sub_group_size):
            chosen = [names[i] for i in members]
            pieces = {k: [] for k in [FP32, *_elementwise_keys(src, chosen)]}
            for name, part in zip(chosen, (parts[i] for i in members)):
                for key, out in pieces.items():
                    full = src.universal.tensors[name][key].reshape(-1)
                    out.append(_flat_range(full, rank * part, (rank + 1) * part))
            flats.append(torch.cat(pieces.pop(FP32)))
            state = {k: _own(v) for k, v in src.universal.scalars.get(chosen[0], {}).items()}
            state.update({k: torch.cat(v) for k, v in pieces.items()})
            states[index] = state
            params.append(index)
            index += 1
        groups.append(_hyper(src, gi, params))
    return stage3_optimizer_state(src, dp, states, groups, flats)


def stage3_optimizer_state(src: ExportSource, dp: int, states: dict, groups: list[dict], flats: list) -> dict:
    """A ZeRO-3 rank's `optimizer_state_dict` around its sub-groups' torch optimizer `states` (by sub-group
    index), param `groups` and `fp32_flat_groups`."""
    return {
        "zero_stage": zero_stage(3),
        "loss_scaler": _scaler(src),
        "dynamic_loss_scale": bool((src.meta.get("loss_scaler") or {}).get("dynamic")),
        "overflow": False,
        "partition_count": dp,
        "optimizer_state_dict": {"state": states, "param_groups": groups},
        "fp32_flat_groups": flats,
    }


def _elementwise_keys(src: ExportSource, names: list[str]) -> list[str]:
    return sorted(set.intersection(*(set(src.universal.tensors[n]) for n in names)) - {FP32})


def _flat_range(full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """full[lo:hi], zero-padded where it runs past the end."""
    out = torch.zeros(hi - lo, dtype=full.dtype)
    n = max(0, min(hi, full.numel()) - lo)
    out[:n].copy_(full[lo : lo + n])
    return out


def _frozen_fragments(src: ExportSource, stage: int, dp: int, rank: int) -> dict:
    """What DeepSpeed records of each frozen parameter: its whole value (stage 2), its partition (stage 3)."""
    out = OrderedDict()
    for name in src.frozen_names():
        if name in src.module:
            full = src.module[name]
            part = stage3_partition(full.numel(), dp)
            out[name] = _flat_range(full.reshape(-1), rank * part, (rank + 1) * part) if stage == 3 else full
    return out


def _save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f, pickle_module=PICKLE_MODULE, pickle_protocol=2))


def write_deepspeed_tag(
    src: ExportSource, out_dir, tag: str, *, stage: int, dp: int, sub_group_size: int | None = None
) -> Path:
    """Write `src` as DeepSpeed 0.19.8's tag `out_dir/tag` for ZeRO `stage` on `dp` data-parallel ranks
    (replacing an existing tag whole) and point `out_dir/latest` at it. Returns the tag directory."""
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"export to DeepSpeed: stage must be 0-3 and dp >= 1, got stage {stage}, dp {dp}")
    if stage == 0 and src.param_dtype != torch.float32:
        raise CheckpointError(
            f"export to DeepSpeed at ZeRO stage 0 with {src.param_dtype} weights: DeepSpeed keeps those in "
            "its FP16_Optimizer, whose layout is not written; export at stage 1, 2 or 3"
        )
    experts = [n for g in src.group_names for n in g if ".deepspeed_moe.experts.deepspeed_experts." in n]
    if experts:  # Note [DeepSpeed MoE checkpoints] (deepspeed_experts.py)
        raise CheckpointError(
            f"export to DeepSpeed: the checkpoint holds MoE experts ({experts[0]}, ...); write DeepSpeed's MoE "
            "layout with deepspeed_experts.write_deepspeed_moe_tag (zerospeed-ckpt export --ep N)"
        )
    if (((src.meta.get("ds_config") or {}).get("expert_parallel")) or {}).get("enabled"):
        raise CheckpointError(  # Note [DeepSpeed AutoEP export] (deepspeed_autoep_export.py)
            "export to DeepSpeed: the checkpoint was saved under AutoEP (expert_parallel); write DeepSpeed's AutoEP "
            "layout with deepspeed_autoep_export.write_deepspeed_autoep_tag (zerospeed-ckpt export --ep N)"
        )
    missing = [n for g in src.group_names for n in g if n not in src.universal.tensors]
    if missing:
        raise CheckpointError(f"export to DeepSpeed: no fp32 master for {missing[:5]}; is the checkpoint complete?")
    root, staging, sub_group_size = stage_tag(src, out_dir, tag, sub_group_size)
    if stage == 3:
        for r in range(dp):
            _save(_model_states(src, 3, dp, _frozen_fragments(src, 3, dp, r)), staging / _ds_name(r, "model"))
    else:
        _save(_model_states(src, stage, dp, _frozen_fragments(src, stage, dp, 0)), staging / MODEL_STATES)
    bf16 = src.param_dtype == torch.bfloat16
    for r in range(dp if stage > 0 else 0):
        if stage == 3:
            osd = _stage3_optim(src, dp, r, sub_group_size)
        elif stage == 1 and bf16 and _uses_bf16_optimizer(src):
            osd = _bf16_optimizer_optim(src, dp, r)
        else:
            osd = _stage12_optim(src, stage, dp, r)
        _save(
            {"optimizer_state_dict": osd, "ds_config": _ds_config(src, stage), "ds_version": DS_LAYOUT_VERSION},
            staging / f"{BF16_PREFIX if bf16 else ''}{_ds_name(r, 'optim')}",
        )
    return publish_tag(root, staging, tag)


def stage_tag(src: ExportSource, out_dir, tag: str, sub_group_size: int | None) -> tuple[Path, Path, int]:
    """(root, a fresh staging directory for `root/tag` that `publish_tag` swaps in, the ZeRO-3 sub_group_size:
    the one given, else the saved config's, else DeepSpeed's default)."""
    if sub_group_size is None:
        zero = (src.meta.get("ds_config") or {}).get("zero_optimization") or {}
        sub_group_size = int(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    return *staging_dir(out_dir, tag), sub_group_size


def staging_dir(out_dir, tag: str) -> tuple[Path, Path]:
    """(root `out_dir`, created, a fresh staging directory for `root/tag` that `publish_tag` swaps in)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{tag}.partial"
    fresh_dir(staging)
    return root, staging


def publish_tag(root: Path, staging: Path, tag: str, latest: str = "latest") -> Path:
    """Swap the staged tag directory in as `root/tag` (Note [tag directory swap] in atomic.py), then point
    `root/latest` (or `latest_universal`) at it. Returns the tag directory."""
    tag_dir = root / tag
    swap_in_dir(staging, tag_dir, root / f".{tag}.previous")
    atomic_write_text(root / latest, tag)
    return tag_dir


def write_universal(src: ExportSource, out_dir, tag: str, *, dp: int = 1) -> Path:
    """Write `src` as a universal folder `out_dir/tag` (Note [universal folders] in deepspeed_import.py, the
    layout DeepSpeed's `ds_to_universal` writes) and point `out_dir/latest_universal` at it. DeepSpeed's
    engine with `checkpoint.load_universal: true` reads it at any stage and data-parallel size; its
    model-states file is looked up by name, so one is written per name it may look for: ZeRO 0-2's
    `mp_rank_00_model_states.pt` and ZeRO 3's `zero_pp_rank_{r}_...` for the `dp` ranks given (they hold no
    weights: a universal load takes those from `zero/`). Returns the folder written."""
    root, staging = staging_dir(out_dir, tag)
    states = _model_states(src, 3, dp, OrderedDict())
    _save(states, staging / MODEL_STATES)
    for r in range(dp):
        _save(states, staging / _ds_name(r, "model"))
    for names in src.group_names:
        for name in names:
            folder = staging / "zero" / name
            folder.mkdir(parents=True)
            for key, value in src.universal.tensors[name].items():
                _save({"param": value.detach().clone()}, folder / f"{key}.pt")
            if "step" in src.universal.scalars.get(name, {}):
                _save(_own(src.universal.scalars[name]["step"]), folder / "step.pt")
    for name in src.frozen_names():  # ds_to_universal writes module tensors without optimizer state the same way
        if name in src.module:
            (staging / "zero" / name).mkdir(parents=True)
            _save({"param": src.module[name].float().clone()}, staging / "zero" / name / "fp32.pt")
    optimizer = _stage12_optim(src, 2, 1, 0)
    for sharded in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups"):
        optimizer.pop(sharded)
    optimizer["param_groups"] = [_hyper(src, gi, [gi]) for gi in range(len(src.group_names))]
    # DeepSpeed's ZeRO-3 loader reads the step and hyperparameters from a ZeRO-3 style "optimizer_state_dict"
    first = next((g[0] for g in src.group_names if g), None)
    step = src.universal.scalars.get(first, {}).get("step") if first is not None else None
    optimizer["optimizer_state_dict"] = {
        "state": {0: {"step": _own(step)}} if step is not None else {},
        "param_groups": copy.deepcopy(optimizer["param_groups"]),
    }
    _save(optimizer, staging / "zero" / "optimizer_state.pt")
    return publish_tag(root, staging, tag, latest="latest_universal")


def _ds_name(rank: int, kind: str) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"


def export_to_deepspeed(
    checkpoint_dir,
    output_dir,
    *,
    stage: int,
    dp: int,
    tag: str | None = None,
    output_tag: str | None = None,
    group_names: list[list[str]] | None = None,
    sub_group_size: int | None = None,
) -> Path:
    """Export a zerospeed checkpoint (the tag `latest` names, or `tag`) as a DeepSpeed 0.19.8 tag for ZeRO
    `stage` on `dp` ranks in `output_dir` (tag `output_tag`, by default the same name), with `latest`;
    DeepSpeed's `engine.load_checkpoint(output_dir)` at that stage and dp resumes it. See
    `read_zerospeed_source` for `group_names`. Returns the tag directory written."""
    tag_dir, _ = resolve_checkpoint(checkpoint_dir, tag)
    src = read_zerospeed_source(checkpoint_dir, tag, group_names)
    return write_deepspeed_tag(
        src, output_dir, output_tag or tag_dir.name, stage=stage, dp=dp, sub_group_size=sub_group_size
    )


def export_universal(
    checkpoint_dir, output_dir, *, dp: int = 1, tag: str | None = None, output_tag: str | None = None
) -> Path:
    """Export a zerospeed checkpoint as DeepSpeed's universal folder `output_dir/<tag>_universal` (or
    `output_tag`) with `latest_universal` (`write_universal`). Returns the folder written."""
    tag_dir, _ = resolve_checkpoint(checkpoint_dir, tag)
    src = read_zerospeed_source(checkpoint_dir, tag)
    return write_universal(src, output_dir, output_tag or f"{tag_dir.name}_universal", dp=dp)
