"""Reading a checkpoint DeepSpeed itself saved: resume a DeepSpeed run in zerospeed.

`engine.load_checkpoint(dir, tag)` on a tag directory holding DeepSpeed's files instead of a zerospeed
manifest comes here (load.py). Note [DeepSpeed checkpoints]: DeepSpeed (0.9 to 0.19) writes, without
tensor or pipeline parallelism,
- ZeRO 0: `mp_rank_00_model_states.pt` holds the module state dict and the torch optimizer's own
  `state_dict()` (states indexed by position in its param groups);
- ZeRO 1/2: the module states as above (weights whole), and per data-parallel rank r
  `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` with that rank's flat fp32 partition of each param
  group (`single_partition_of_fp32_groups`), the optimizer's states over the same flat partition
  (`base_optimizer_state`), and `param_slice_mappings`: for each group, each parameter fragment the
  partition holds as (numel, start in the partition). A parameter's fragments across ranks, in rank
  order, make its flat value;
- ZeRO 3: per rank r `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (buffers; parameters are empty
  placeholders; frozen parameters' fragments) and `..._optim_states.pt` with its flat fp32 sub-groups
  (`fp32_flat_groups`) and their optimizer states. Each parameter, in `param_shapes` order, holds
  ceil(numel / dp) elements of every rank's flat buffer (the last rank's padded); rank order makes
  its value, cut to numel (the rule of DeepSpeed's `zero_to_fp32.py`).
This module turns those into the universal form (`universal.UniversalState`: each parameter's full fp32
tensor and its elementwise optimizer states), from which the engine fills its own partitions at any
stage and world size, as for a resharded zerospeed checkpoint; plus the module's buffers and frozen
weights, the optimizer's hyperparameters, LR-scheduler state, counters and loss scale.

DeepSpeed pickles a few of its own classes into these files (its loss scaler, `ZeroStageEnum`,
`fragment_address`); they are read here as plain records, without importing DeepSpeed. Refused with an
error naming the file: tensor-parallel checkpoints (deepspeed_tp.py reads them for
engine.load_checkpoint: Note [DeepSpeed tensor-parallel checkpoints]; their universal folders are read
here), MoE ones (deepspeed_experts.py reads them for engine.load_checkpoint: Note [DeepSpeed MoE
checkpoints]), and pipeline ones outside a pipeline engine
(deepspeed_pipeline.py reads them: Note [DeepSpeed pipeline checkpoints]).

Note [DeepSpeed's bf16 files]: with `bf16.enabled` DeepSpeed names every optimizer file
`bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (at any ZeRO stage: the prefix follows the dtype, not
the optimizer). At ZeRO 2 and 3 their content is the ZeRO layout above, and at ZeRO 1 too by default
(DeepSpeed 0.19.8 accumulates bf16 gradients in bf16 unless `data_types.grad_accum_dtype` says otherwise).
At ZeRO 1 with `grad_accum_dtype: "fp32"` DeepSpeed trains with its `BF16_Optimizer`, whose file holds the same
`single_partition_of_fp32_groups` / `base_optimizer_state` / `param_slice_mappings` as ZeRO 1/2 but each
rank's partition whole, its alignment padding included (ZeRO 1/2 cut the padding off), `partition_count`
per group, `clip_grad`, and no loss scaler nor `zero_stage`: read through the same fragments, it gives the
same universal form. The module state holds the bf16 weights; the fp32 masters are the optimizer's.

Note [universal folders]: DeepSpeed's `ds_to_universal` (0.19.8) writes a folder holding copies of the
tag's model-states files (`mp_rank_00_model_states.pt`; at ZeRO 3 `zero_pp_rank_{r}_mp_rank_00_model_states.pt`)
and `zero/`: per parameter (and per module tensor it found no optimizer state for) a directory
`zero/<name>/` with `fp32.pt` and one file per optimizer state (`exp_avg.pt`, ...), each a dict whose
"param" is the full tensor (from a ZeRO-3 tag: the flat tensor itself), and `step.pt` holding the step (from a
ZeRO-3 tag there is none: the step is in `optimizer_state.pt`'s "optimizer_state_dict"); and
`zero/optimizer_state.pt`, rank 0's optimizer state dict without its ZeRO-1/2 partitions, with the
hyperparameters under "param_groups".
`engine.load_checkpoint` with `checkpoint.load_universal: true` reads such a folder (the tag `latest_universal`
names, as DeepSpeed's loader does) into any stage and data-parallel size; this module reads it into the
same universal form as the other DeepSpeed checkpoints (`deepspeed_export.write_universal` writes one).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32, UniversalState

MODEL = "mp_rank_00_model_states.pt"
BF16_PREFIX = "bf16_"  # DeepSpeed's optimizer files under bf16 (Note [DeepSpeed's bf16 files])
UNIVERSAL_OPTIMIZER = "zero/optimizer_state.pt"
# DeepSpeed's top-level model-states keys; any other key is the user's client_state
RESERVED = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "mp_rank",
        "iteration",
    }
)


META_KEYS = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_config", "ds_version")


class _Record:
    """A DeepSpeed object read back as its constructor arguments and attributes."""

    def __new__(cls, *args, **kwargs):  # (pickle rebuilds a namedtuple, fragment_address, through __new__)
        obj = super().__new__(cls)
        obj.args, obj.kwargs = args, kwargs
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __int__(self):  # ZeroStageEnum(3)
        return int(self.args[0])


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _Record
        return super().find_class(module, name)


class _PickleModule:
    """`torch.load(pickle_module=...)`: DeepSpeed's classes as `_Record`s, everything else as usual."""

    Unpickler = _Unpickler
    __name__ = "zerospeed_deepspeed_unpickle"

    @staticmethod
    def load(f, **kwargs):
        return _Unpickler(f, **kwargs).load()


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule, mmap=True)
    except Exception as exc:  # noqa: BLE001 — name the file whatever went wrong
        raise CheckpointError(
            f"{path}: cannot read it as a DeepSpeed checkpoint file ({type(exc).__name__}: {exc})"
        ) from exc


def is_universal_folder(tag_dir: Path) -> bool:
    """A folder DeepSpeed's `ds_to_universal` wrote (Note [universal folders])."""
    return (Path(tag_dir) / UNIVERSAL_OPTIMIZER).is_file()


def is_deepspeed_tag(tag_dir: Path) -> bool:
    """DeepSpeed's files and no zerospeed manifest."""
    return not (tag_dir / "zerospeed_manifest.json").exists() and (
        (tag_dir / MODEL).exists() or (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()
    )


@dataclass
class DeepSpeedCheckpoint:
    tag_dir: Path
    stage: int
    dp: int
    universal: UniversalState
    module: dict[str, torch.Tensor]  # buffers and frozen weights (and, below stage 3, every weight)
    param_groups: list[dict]  # the optimizer's hyperparameters per group
    meta: dict = field(default_factory=dict)  # counters, lr_scheduler, loss scale, ds_config
    client_state: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)  # group_names, module_keys, buffer_names, shared_params


def read_deepspeed_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form of a DeepSpeed checkpoint (the named trainable parameters only, all when None).
    `group_names`: the trainable parameters' names per optimizer param group, in order; a ZeRO-0
    checkpoint records no names for its optimizer's states (they are indexed by position), which
    follow the order the parameters were given to `initialize` in."""
    tag_dir = Path(tag_dir)
    stage3 = not (tag_dir / MODEL).exists()
    model = _load(tag_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else MODEL))
    _refuse(tag_dir, model)
    dp = int(model.get("dp_world_size") or 1)
    shapes = param_shapes(tag_dir, model, group_names)
    if is_universal_folder(tag_dir):
        if int(model.get("mp_world_size") or 1) > 1:  # tp rank 0's param_shapes; the folder's tensors are full
            shapes = [{n: _universal_shape(tag_dir, n) for n in g} for g in shapes]
        ckpt = _read_universal(tag_dir, model, dp, shapes, names)
    elif stage3:
        ckpt = _read_stage3(tag_dir, model, dp, shapes, names)
    elif model.get("optimizer") is not None or optim_prefix(tag_dir) is None:
        ckpt = _read_stage0(tag_dir, model, shapes, names)
    else:
        ckpt = _read_stage12(tag_dir, model, dp, shapes, names)
    return describe(ckpt, model, shapes)


def describe(ckpt: DeepSpeedCheckpoint, model: dict, shapes: list[dict]) -> DeepSpeedCheckpoint:
    """`ckpt` with the meta, client state and layout of its model-states file `model` (`shapes`: its
    param groups' {name: shape})."""
    ckpt.meta = model_meta(model) | ckpt.meta
    ckpt.client_state = {k: v for k, v in model.items() if k not in RESERVED}
    ckpt.layout = {
        "group_names": [list(g) for g in shapes],
        "shapes": {n: tuple(int(d) for d in shape) for g in shapes for n, shape in g.items()},
        "module_keys": list(model["module"]),
        "buffer_names": list(model.get("buffer_names") or []),
        "shared_params": dict(model.get("shared_params") or {}),
    }
    return ckpt


def model_meta(model: dict) -> dict:
    """The counters, LR-scheduler state and config a DeepSpeed model-states file records (its checkpoint meta)."""
    return {k: model.get(k) for k in META_KEYS}


def param_shapes(tag_dir: Path, model: dict, group_names) -> list[dict]:
    """The trained parameters' {name: shape} per optimizer param group of a DeepSpeed model-states file; a
    ZeRO-0 file records none, and `group_names` (the loading model's order) names them."""
    if model.get("param_shapes") is not None:
        return [dict(g) for g in model["param_shapes"]]
    if group_names is not None:
        return [{n: tuple(model["module"][n].shape) for n in g} for g in group_names]
    raise CheckpointError(
        f"{tag_dir}: a ZeRO-0 DeepSpeed checkpoint names no parameters for its optimizer "
        "states; load it through engine.load_checkpoint (which knows the model's order)"
    )


def refuse_autoep(tag_dir: Path, model: dict) -> None:
    """Refuse a tag DeepSpeed's AutoEP saved (its model states list `ds_autoep_layers`) in the dense and MoE
    readers: DeepSpeed's AutoEP layer names the router and the stacked experts its own way
    (`mlp.router.gate.weight`, `mlp.experts.w1/w2/w3`) and at ZeRO 3 partitions each rank's expert param group over
    its expert-data-parallel group, not over dp, so neither reads it right. ZeRO-3 and ZeRO-1/2 AutoEP tags have
    their own readers (deepspeed_autoep.py, deepspeed_autoep_zero12.py, deepspeed_autoep_zero0.py, chosen by
    engine.load_checkpoint); fixtures autoep_zero{0,1,2,3}_ep2."""
    layers = model.get("ds_autoep_layers")
    if not layers:
        return
    where = f"{tag_dir}: a DeepSpeed AutoEP checkpoint (ds_autoep_layers: {[e.get('module_path') for e in layers]})"
    if all(e.get("checkpoint_format") == "zero3_partitioned" for e in layers) and not is_universal_folder(tag_dir):
        raise CheckpointError(
            f"{where} at ZeRO 3 is read by deepspeed_autoep.read_deepspeed_autoep_zero3_checkpoint: load it with "
            "engine.load_checkpoint into the transformers model under zerospeed's AutoEP"
        )
    if all(e.get("checkpoint_format") == "per_expert_files" for e in layers) and optim_prefix(tag_dir) is not None:
        raise CheckpointError(
            f"{where} at ZeRO 1/2 is read by deepspeed_autoep_zero12.read_deepspeed_autoep_zero12_checkpoint: load "
            "it with engine.load_checkpoint into the transformers model under zerospeed's AutoEP"
        )
    if (tag_dir / "expp_rank_0_mp_rank_00_optim_states.pt").exists():
        raise CheckpointError(
            f"{where} at ZeRO 0 is read by deepspeed_autoep_zero0.read_deepspeed_autoep_zero0_checkpoint: load it "
            "with engine.load_checkpoint into the transformers model under zerospeed's AutoEP"
        )
    raise CheckpointError(
        f"{where} is not read here (only ZeRO 0-3 AutoEP tags are, by engine.load_checkpoint); DeepSpeed's "
        "ds_to_universal.py writes its full weights (zero/NAME/fp32.pt): rename them to the transformers model's "
        "(mlp.router.gate -> mlp.gate; experts.w1 and w3, concatenated on dim 1 -> experts.gate_up_proj; w2 -> "
        "down_proj) and load them with load_module_only-style code"
    )


def _refuse(tag_dir: Path, model: dict) -> None:
    refuse_autoep(tag_dir, model)
    tp = int(model.get("mp_world_size") or 1) > 1 or any(tag_dir.glob("*mp_rank_01*"))
    if tp and not is_universal_folder(tag_dir):  # (a universal folder holds full tensors at any tp)
        raise CheckpointError(
            f"{tag_dir}: a tensor-parallel DeepSpeed checkpoint (mp_world_size "
            f"{model.get('mp_world_size')}) is read by deepspeed_tp.read_deepspeed_tp_checkpoint "
            "(engine.load_checkpoint chooses it), not here"
        )
    if any(tag_dir.glob("layer_*")) or any(tag_dir.glob("*expp_rank*")):
        raise CheckpointError(
            f"{tag_dir}: a pipeline or MoE DeepSpeed checkpoint is not read here (a pipeline one loads into a "
            "PipelineModule's engine; a MoE one (layer_i_expert_e files) through engine.load_checkpoint or "
            "deepspeed_experts.read_deepspeed_moe_checkpoint)"
        )


def optim_prefix(tag_dir: Path) -> str | None:
    """The prefix of the tag's optimizer files, "" or "bf16_" (Note [DeepSpeed's bf16 files]); None without any."""
    for prefix in ("", BF16_PREFIX):
        if (tag_dir / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt").exists():
            return prefix
    return None


def _optim_files(tag_dir: Path, dp: int, mp_rank: int = 0) -> list[dict]:
    out, prefix = [], optim_prefix(tag_dir) or ""
    for r in range(dp):
        path = tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_optim_states.pt"
        if not path.exists():
            raise CheckpointError(f"{tag_dir}: {path.name} is missing (the checkpoint was saved by {dp} ranks)")
        out.append(_load(path)["optimizer_state_dict"])
    return out


def _hyperparameters(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _elementwise(state: dict, numel: int) -> dict[str, torch.Tensor]:
    return {k: v.reshape(-1) for k, v in state.items() if torch.is_tensor(v) and v.numel() == numel and v.dim() > 0}


def _scalars(state: dict) -> dict:
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}


def _fragment(frag) -> tuple[int, int]:
    """(numel, start) of DeepSpeed's `fragment_address` (a dataclass; a namedtuple in older versions)."""
    if hasattr(frag, "numel") and hasattr(frag, "start"):
        return int(frag.numel), int(frag.start)
    return int(frag.args[0]), int(frag.args[1])


def _loss_scale(record) -> dict:
    """DeepSpeed's loss scaler as zerospeed's `DynamicLossScaler.state_dict()` (None when static)."""
    if record is None or not getattr(record, "dynamic", False):
        return {}
    return {
        "loss_scaler": {
            "dynamic": True,
            "scale": float(record.cur_scale),
            "cur_iter": int(record.cur_iter),
            "last_overflow_iter": int(record.last_overflow_iter),
            "cur_hysteresis": int(getattr(record, "cur_hysteresis", 1)),
        }
    }


def _read_stage0(tag_dir: Path, model: dict, shapes: list[dict], names) -> DeepSpeedCheckpoint:
    module = dict(model["module"])
    opt = model.get("optimizer") or {"state": {}, "param_groups": []}
    uni = UniversalState()
    index = 0
    for gi, group in enumerate(shapes):
        saved_group = opt["param_groups"][gi]["params"] if gi < len(opt["param_groups"]) else []
        for pos, name in enumerate(group):
            key = saved_group[pos] if pos < len(saved_group) else index
            index += 1
            if names is not None and name not in names:
                continue
            value = module[name].float().reshape(-1)
            state = opt["state"].get(key, {})
            uni.tensors[name] = {FP32: value, **_elementwise(state, value.numel())}
            uni.scalars[name], uni.groups[name] = _scalars(state), gi
    return DeepSpeedCheckpoint(
        tag_dir, 0, int(model.get("dp_world_size") or 1), uni, module, _hyperparameters(opt["param_groups"])
    )


def _read_stage12(
    tag_dir: Path, model: dict, dp: int, shapes: list[dict], names, mp_rank: int = 0
) -> DeepSpeedCheckpoint:
    ranks = _optim_files(tag_dir, dp, mp_rank)  # (tp rank mp_rank's files: deepspeed_tp.py)
    first = ranks[0]
    base = first["base_optimizer_state"]
    uni = stage12_universal(tag_dir, ranks, shapes, names)
    return DeepSpeedCheckpoint(
        tag_dir,
        int(first.get("zero_stage", 1)),  # (BF16_Optimizer records none: DeepSpeed uses it at ZeRO 1)
        dp,
        uni,
        dict(model["module"]),
        _hyperparameters(base["param_groups"]),
        meta=_loss_scale(first.get("loss_scaler")),
    )


def stage12_universal(tag_dir: Path, ranks: list[dict], shapes: list[dict], names, rename=None) -> UniversalState:
    """Every parameter's full fp32 master and elementwise optimizer states, joined from DeepSpeed's ZeRO-1/2
    partitions: `ranks` holds each rank's `optimizer_state_dict` in rank order, `shapes` each param group's
    {name: shape} (`names`: only these, or all with None). `rename(name, rank, group)`: the name a rank's
    fragment stands for (MoE experts: their global names, deepspeed_experts.py)."""
    base = ranks[0]["base_optimizer_state"]
    uni = UniversalState()
    for gi, group in enumerate(shapes):
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        for r, osd in enumerate(ranks):
            fp32 = osd["single_partition_of_fp32_groups"][gi]
            state = osd["base_optimizer_state"]["state"].get(gi, {})
            states = {k: v.reshape(-1) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
            for name, frag in osd["param_slice_mappings"][gi].items():
                name = rename(name, r, gi) if rename is not None else name
                numel, start = _fragment(frag)
                slot = pieces.setdefault(name, {FP32: []})
                slot[FP32].append(fp32[start : start + numel])
                for k, v in states.items():
                    slot.setdefault(k, []).append(v[start : start + numel])
        for name, shape in group.items():
            if names is not None and name not in names:
                continue
            if name not in pieces:
                raise CheckpointError(f"{tag_dir}: no rank's param_slice_mappings holds {name}")
            full = {k: torch.cat(v) for k, v in pieces[name].items()}
            if full[FP32].numel() != math.prod(shape):
                raise CheckpointError(
                    f"{tag_dir}: the fragments of {name} hold {full[FP32].numel()} elements, its "
                    f"shape {tuple(shape)} needs {math.prod(shape)}"
                )
            uni.tensors[name] = full
            uni.scalars[name] = _scalars(base["state"].get(gi, {}))
            uni.groups[name] = gi
    return uni


def _read_universal(tag_dir: Path, model: dict, dp: int, shapes: list[dict], names) -> DeepSpeedCheckpoint:
    opt = _load(tag_dir / UNIVERSAL_OPTIMIZER)
    zero3_step = ((opt.get("optimizer_state_dict") or {}).get("state") or {}).get(0, {}).get("step")
    uni = UniversalState()
    for gi, group in enumerate(shapes):
        for name, shape in group.items():
            if names is not None and name not in names:
                continue
            folder = tag_dir / "zero" / name
            if not (folder / "fp32.pt").is_file():
                raise CheckpointError(f"{tag_dir}: the universal checkpoint has no {folder / 'fp32.pt'}")
            tensors, scalars = {}, {}
            for path in sorted(folder.glob("*.pt")):
                value = _load(path)
                if path.stem == "step":
                    scalars["step"] = value
                    continue
                tensors[path.stem] = (value["param"] if isinstance(value, dict) else value).detach().reshape(-1)
            if tensors[FP32].numel() != math.prod(shape):
                raise CheckpointError(
                    f"{folder}: fp32.pt holds {tensors[FP32].numel()} elements, {name} has shape {tuple(shape)}; "
                    "a tensor-parallel universal checkpoint is not read here"
                )
            uni.tensors[name] = tensors
            uni.scalars[name] = _universal_step(scalars or {"step": zero3_step})
            uni.groups[name] = gi
    module = {n: t for n, t in model["module"].items() if t.numel() > 0}
    stage = int(opt.get("zero_stage", 2))
    return DeepSpeedCheckpoint(
        tag_dir, stage, dp, uni, module, _hyperparameters(opt["param_groups"]), meta=_loss_scale(opt.get("loss_scaler"))
    )


def _universal_shape(tag_dir: Path, name: str) -> tuple[int, ...]:
    value = _load(tag_dir / "zero" / name / "fp32.pt")
    return tuple((value["param"] if isinstance(value, dict) else value).shape)


def _universal_step(scalars: dict) -> dict:
    """`step.pt` as torch's Adam keeps it: a float tensor (DeepSpeed may save a plain number)."""
    step = scalars.get("step")
    if step is None:
        return {}
    return {"step": step.clone().float() if torch.is_tensor(step) else torch.tensor(float(step))}


def _read_stage3(tag_dir: Path, model: dict, dp: int, shapes: list[dict], names) -> DeepSpeedCheckpoint:
    ranks = _optim_files(tag_dir, dp)
    flats, states = [], []
    for osd in ranks:
        flats.append(torch.cat([g.reshape(-1) for g in osd["fp32_flat_groups"]]))
        subs = osd["optimizer_state_dict"]["state"]
        keys = [k for k, v in subs.get(0, {}).items() if torch.is_tensor(v) and v.dim() > 0]
        states.append({k: torch.cat([subs[i][k].reshape(-1) for i in sorted(subs)]) for k in keys})
    scalars = _scalars(ranks[0]["optimizer_state_dict"]["state"].get(0, {}))
    uni, offset = UniversalState(), 0
    for gi, group in enumerate(shapes):
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / dp)
            if names is None or name in names:
                uni.tensors[name] = {FP32: torch.cat([f[offset : offset + part] for f in flats])[:numel]}
                for k in states[0]:
                    uni.tensors[name][k] = torch.cat([s[k][offset : offset + part] for s in states])[:numel]
                uni.scalars[name], uni.groups[name] = dict(scalars), gi
            offset += part
    if offset > flats[0].numel():
        raise CheckpointError(
            f"{tag_dir}: its parameters need {offset} elements per rank, the flat groups hold {flats[0].numel()}"
        )
    module = {n: t for n, t in model["module"].items() if n in set(model.get("buffer_names") or [])}
    frozen = model.get("frozen_param_shapes") or {}
    if frozen:
        frags = [
            _load(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")["frozen_param_fragments"] for r in range(dp)
        ]
        for name, shape in frozen.items():
            module[name] = torch.cat([f[name].reshape(-1) for f in frags])[: math.prod(shape)].view(shape)
    hyper = _hyperparameters(ranks[0]["optimizer_state_dict"]["param_groups"])
    return DeepSpeedCheckpoint(
        tag_dir, 3, dp, uni, module, hyper[: len(shapes)], meta=_loss_scale(ranks[0].get("loss_scaler"))
    )
