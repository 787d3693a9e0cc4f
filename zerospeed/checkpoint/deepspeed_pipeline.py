"""DeepSpeed's pipeline checkpoints: reading a tag DeepSpeed's PipelineEngine saved (ZeRO 0 and 1, tied layers)
into the universal form zerospeed's pipeline engine fills its masters from.

Note [DeepSpeed pipeline checkpoints]: DeepSpeed's PipelineEngine (0.19.8) writes per layer
`layer_{i:02d}-model_states.pt` (the layer's own state dict; a `-model_XX` tensor-parallel suffix under tp;
a tied layer's shared module in each holder's file, except a tied layer with a `forward_fn`, which has
no file) and per stage s `mp_rank_{s:02d}_model_states.pt` with no module, the stage's `buffer_names`,
the LR scheduler and the counters. A stage module's parameters are, in order, its tied modules
(`tied_modules.{key}.{name}`, in the order the stage's layers first use them) and then its other layers'
(`{layer}.{name}`), each in the layer's own order.
- ZeRO 0: the stage file holds the torch optimizer's `state_dict()` over those parameters, indexed by
  position and with no names; each parameter's master is its layer-file value (fp32 runs: the weights
  are the masters). The positions are matched to names by the stage bounds DeepSpeed used (the caller
  gives them: the module's partition method at DeepSpeed's stage count) or, without tied layers, by
  walking the layer files in order.
- ZeRO 1 (DeepSpeed's pipeline refuses 2 and 3): the stage file names its parameters (`param_shapes`) and
  data-parallel rank d of stage s writes `zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt`, the ZeRO-1/2
  flat partition of that stage's parameters (Note [DeepSpeed checkpoints] in deepspeed_import.py).
A tied module's copies on several stages step on the same summed gradient, so their masters and states are
equal; the lowest stage's is read. Refused with an error naming the tag: several param groups, and files
whose counts or shapes do not match. With tensor parallelism inside the stages each tp rank's files are read
as such a tag of its local tensors (`tp`, `tp_rank`) and joined by deepspeed_pipeline_tp.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_export import (
    DS_LAYOUT_VERSION,
    ExportSource,
    _hyper,
    _model_states,
    _own,
    _save,
    _stage12_optim,
    publish_tag,
    staging_dir,
)
from zerospeed.checkpoint.deepspeed_import import (
    RESERVED,
    _elementwise,
    _hyperparameters,
    _load,
    _read_stage12,
    _read_universal,
    _scalars,
    _universal_shape,
    is_universal_folder,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32, UniversalState

TIED = "tied_modules."


def stage_file(stage: int) -> str:
    """DeepSpeed's per-stage model-states file of a pipeline tag."""
    return f"mp_rank_{stage:02d}_model_states.pt"


def layer_file(idx: int) -> str:
    return f"layer_{idx:02d}-model_states.pt"


def optim_file(dp_rank: int, stage: int) -> str:
    """DeepSpeed's ZeRO-1 optimizer file of data-parallel rank `dp_rank` of pipeline stage `stage`."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


@dataclass
class DeepSpeedPipeline:
    """A DeepSpeed pipeline tag (Note [DeepSpeed pipeline checkpoints]) as zerospeed's pipeline engine loads it."""

    tag_dir: Path
    stages: int
    zero_stage: int
    # each trainable parameter under DeepSpeed's stage-module name ("{layer}.{name}", tied
    # "tied_modules.{key}.{name}"): its fp32 master and elementwise optimizer states, scalar states
    universal: UniversalState
    layers: dict[int, dict[str, torch.Tensor]]  # layer index -> its layer file's state dict
    param_groups: list[dict]  # the optimizer's hyperparameters (stage 0's)
    meta: dict  # global_steps, global_samples, skipped_steps, lr_scheduler, ds_version
    client_state: dict = field(default_factory=dict)


def is_deepspeed_pipeline_tag(tag_dir: Path) -> bool:
    """DeepSpeed's pipeline layout: per-layer module files and per-stage model states, no zerospeed engine state."""
    tag_dir = Path(tag_dir)
    return (
        not (tag_dir / "engine_states.pt").exists()
        and (tag_dir / stage_file(0)).exists()
        and any(tag_dir.glob("layer_*-model_states.pt"))
    )


def read_deepspeed_pipeline(
    tag_dir: Path,
    tied: dict[int, str] | None = None,
    bounds: Callable[[int], list[int]] | None = None,
    *,
    tp: int = 1,
    tp_rank: int = 0,
) -> DeepSpeedPipeline:
    """Note [DeepSpeed pipeline checkpoints]. `tied`: layer index -> tie key of the model's tied layers;
    `bounds(n)`: the layer bounds of the model's partition into n stages (needed for ZeRO-0 tags with tied
    layers). `tp` > 1: tp rank `tp_rank`'s files of a tag with tensor parallelism inside the stages, its local
    tensors (Note [DeepSpeed pipeline checkpoints with tp] in deepspeed_pipeline_tp.py joins the ranks)."""
    tag_dir, tied = Path(tag_dir), dict(tied or {})
    files = sorted(
        tag_dir.glob("layer_*-model_states.pt" if tp == 1 else f"layer_*-model_{tp_rank:02d}-model_states.pt")
    )
    if tp == 1 and (any(f.name.count("-") > 1 for f in files) or any(tag_dir.glob("*mp_rank_*_mp_rank_*"))):
        raise CheckpointError(
            f"{tag_dir}: a DeepSpeed pipeline checkpoint with tensor parallelism inside the stages is read by "
            "deepspeed_pipeline_tp.read_deepspeed_pipeline_tp (a PipelineModule engine's load_checkpoint does)"
        )
    layers = {int(f.name.split("-")[0][len("layer_") :]): _load(f) for f in files}
    stages = []
    while (tag_dir / stage_file(len(stages) * tp + tp_rank)).exists():  # (DeepSpeed's mp rank: stage * tp + tp rank)
        stages.append(_load(tag_dir / stage_file(len(stages) * tp + tp_rank)))
    zero1 = (tag_dir / optim_file(0, tp_rank)).exists()
    uni, param_groups = UniversalState(), None
    for s, st in enumerate(stages):
        if zero1:
            dp, shapes = int(st.get("dp_world_size") or 1), _shapes(tag_dir, s, st)
            part = _read_stage12(tag_dir, {**st, "module": {}}, dp, shapes, None, s * tp + tp_rank)
            part_uni, groups = part.universal, part.param_groups
        else:
            names = _stage_names(tag_dir, s, len(stages), layers, stages, tied, bounds)
            part_uni, groups = _stage0(tag_dir, s, st, names, layers, tied)
        if len(groups) != 1:
            raise CheckpointError(
                f"{tag_dir / stage_file(s)}: the optimizer holds {len(groups)} param groups; DeepSpeed "
                "pipeline checkpoints are read with one param group per stage"
            )
        param_groups = param_groups or groups
        for name, tensors in part_uni.tensors.items():
            if name not in uni.tensors:  # a tied module: the lowest stage's copy
                uni.tensors[name], uni.scalars[name], uni.groups[name] = tensors, part_uni.scalars[name], 0
    first = stages[0]
    meta = {k: first.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_version")}
    return DeepSpeedPipeline(
        tag_dir,
        len(stages),
        1 if zero1 else 0,
        uni,
        layers,
        param_groups or [],
        meta,
        {k: v for k, v in first.items() if k not in RESERVED},
    )


# Note [DeepSpeed pipeline universal folders]: DeepSpeed's `ds_to_universal` (0.19.8) converts a ZeRO-1 pipeline
# tag: `zero/<name>/` per parameter under the stage-module names of Note [DeepSpeed pipeline checkpoints] (a tied
# module once, as `tied_modules.{key}.{name}`), `zero/optimizer_state.pt`, and copies of the per-stage
# `mp_rank_{s:02d}_model_states.pt` (no module, the stage's `param_shapes`, counters, LR scheduler). It copies no
# layer files: the weights are the fp32 values, as DeepSpeed's PipelineEngine takes them (its module keeps its
# own buffers). zerospeed's PipelineEngine with `checkpoint.load_universal: true` reads it at any stage count,
# data-parallel size and ZeRO stage 0-2; a data-parallel engine refuses it (`refuse_pipeline_universal`).


def is_deepspeed_pipeline_universal(tag_dir: Path) -> bool:
    """A universal folder converted from a DeepSpeed pipeline tag (its stage files hold no module)."""
    tag_dir = Path(tag_dir)
    return (
        is_universal_folder(tag_dir)
        and (tag_dir / stage_file(0)).is_file()
        and _load(tag_dir / stage_file(0)).get("module", {}) is None
    )


def refuse_pipeline_universal(tag_dir: Path) -> None:
    """A data-parallel engine does not read a pipeline universal folder: its names are layer indices."""
    if is_deepspeed_pipeline_universal(tag_dir):
        raise CheckpointError(
            f"{tag_dir}: a universal folder converted from a DeepSpeed pipeline checkpoint (parameters named by "
            "layer index and tied_modules.*) loads into a PipelineModule's engine (zerospeed.pipe) with "
            "checkpoint.load_universal: true, not into a data-parallel engine; build the model as a PipelineModule "
            "(num_stages=1 runs it without pipelining)"
        )


def read_deepspeed_pipeline_universal(tag_dir: Path, tp: int = 1) -> DeepSpeedPipeline:
    """Note [DeepSpeed pipeline universal folders]: the folder in the form `read_deepspeed_pipeline` gives (no
    layer files: the weights are the universal fp32 tensors). `tp` > 1: converted from a tag with tp inside the
    stages: tp rank 0's stage files, the parameters at their full shapes (deepspeed_pipeline_tp.py)."""
    tag_dir = Path(tag_dir)
    stages = []
    while (tag_dir / stage_file(len(stages) * tp)).exists():
        stages.append(_load(tag_dir / stage_file(len(stages) * tp)))
    uni, param_groups = UniversalState(), None
    for s, st in enumerate(stages):
        shapes = _shapes(tag_dir, s, st)
        if tp > 1:  # (the stage files record tp rank 0's local shapes)
            shapes = [{n: _universal_shape(tag_dir, n) for n in g} for g in shapes]
        part = _read_universal(tag_dir, {**st, "module": {}}, int(st.get("dp_world_size") or 1), shapes, None)
        if len(part.param_groups) != 1 or len(shapes) != 1:
            raise CheckpointError(
                f"{tag_dir}: the optimizer holds {len(part.param_groups)} param groups; DeepSpeed pipeline "
                "checkpoints are read with one param group per stage"
            )
        param_groups = param_groups or part.param_groups
        for name, tensors in part.universal.tensors.items():
            if name not in uni.tensors:  # a tied module: one folder for all its stages
                uni.tensors[name], uni.scalars[name], uni.groups[name] = tensors, part.universal.scalars[name], 0
    first = stages[0]
    meta = {k: first.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_version")}
    client = {k: v for k, v in first.items() if k not in RESERVED}
    return DeepSpeedPipeline(tag_dir, len(stages), 1, uni, {}, param_groups or [], meta, client)


def _shapes(tag_dir: Path, s: int, st: dict) -> list[dict]:
    if st.get("param_shapes") is None:
        raise CheckpointError(f"{tag_dir / stage_file(s)}: a ZeRO-1 pipeline stage file without param_shapes")
    return [dict(g) for g in st["param_shapes"]]


def _tied_state(tag_dir: Path, key: str, layers: dict, tied: dict[int, str]) -> dict:
    for idx in sorted(i for i, k in tied.items() if k == key):
        if idx in layers:
            return layers[idx]
    holders = sorted(i for i, k in tied.items() if k == key)
    raise CheckpointError(
        f"{tag_dir}: no layer file holds the tied module {key!r} (do its layers {holders} all have a "
        "forward_fn? DeepSpeed writes no file for those), so its weights cannot be read"
    )


def _stage_names(tag_dir, s, num_stages, layers, stages, tied, bounds) -> list[str]:
    """DeepSpeed's names of stage s's parameters, in its optimizer's order (ZeRO 0 records none)."""
    buffers = set(stages[s].get("buffer_names") or [])
    if not tied:  # the layer files' parameters in layer order, the stages' positions one after the other
        order = [f"{i}.{k}" for i in sorted(layers) for k in layers[i] if f"{i}.{k}" not in buffers]
        counts = [sum(len(g["params"]) for g in _optim(tag_dir, t, st)["param_groups"]) for t, st in enumerate(stages)]
        if sum(counts) != len(order):
            raise CheckpointError(
                f"{tag_dir}: the layer files hold {len(order)} parameters, the stages' optimizers {sum(counts)}; "
                "is it a checkpoint of this model?"
            )
        return order[sum(counts[:s]) : sum(counts[: s + 1])]
    if bounds is None:
        raise CheckpointError(
            f"{tag_dir}: a ZeRO-0 DeepSpeed pipeline checkpoint with tied layers is read with the model's stage "
            "bounds; load it through a PipelineModule's engine"
        )
    lo, hi = bounds(num_stages)[s : s + 2]
    keys = list(dict.fromkeys(tied[i] for i in range(lo, hi) if i in tied))
    names = []
    for key in keys:
        state = _tied_state(tag_dir, key, layers, tied)
        names += [f"{TIED}{key}.{k}" for k in state if f"{TIED}{key}.{k}" not in buffers]
    for i in range(lo, hi):
        if i not in tied and i in layers:
            names += [f"{i}.{k}" for k in layers[i] if f"{i}.{k}" not in buffers]
    return names


def _optim(tag_dir: Path, s: int, st: dict) -> dict:
    opt = st.get("optimizer")
    if opt is None:
        raise CheckpointError(f"{tag_dir / stage_file(s)}: holds no optimizer state (ZeRO 0 stores it there)")
    return opt


def _value(name: str, layers: dict, tied: dict[int, str], tag_dir: Path) -> torch.Tensor:
    if name.startswith(TIED):
        key, _, rest = name[len(TIED) :].partition(".")
        return _tied_state(tag_dir, key, layers, tied)[rest]
    idx, _, rest = name.partition(".")
    return layers[int(idx)][rest]


def _stage0(tag_dir, s, st, names, layers, tied) -> tuple[UniversalState, list[dict]]:
    opt = _optim(tag_dir, s, st)
    keys = [k for g in opt["param_groups"] for k in g["params"]]
    if len(keys) != len(names):
        raise CheckpointError(
            f"{tag_dir / stage_file(s)}: its optimizer holds {len(keys)} parameters, the layer files give this "
            f"stage {len(names)} ({names[:4]}...); is it a checkpoint of this model (same layers and partition)?"
        )
    uni = UniversalState()
    for key, name in zip(keys, names):
        value = _value(name, layers, tied, tag_dir).float().reshape(-1)
        state = opt["state"].get(key, {})
        elementwise = _elementwise(state, value.numel())
        if any(torch.is_tensor(v) and v.dim() > 0 and v.numel() != value.numel() for v in state.values()):
            raise CheckpointError(
                f"{tag_dir / stage_file(s)}: optimizer state {key} does not have the {value.numel()} elements of "
                f"{name}; is it a checkpoint of this model (same layers and partition)?"
            )
        uni.tensors[name] = {FP32: value, **elementwise}
        uni.scalars[name], uni.groups[name] = _scalars(state), 0
    return uni, _hyperparameters(opt["param_groups"])


# ---- export: a zerospeed pipeline checkpoint as DeepSpeed's pipeline tag ----------------------------------

# Note [pipeline export]: a zerospeed PipelineEngine checkpoint saved at ZeRO stage 0 (per-layer
# `layer_XX-optim_states.pt`: each parameter's fp32 master and optimizer state) is written as the tag
# DeepSpeed's PipelineEngine saves (Note [DeepSpeed pipeline checkpoints]) at the saved stage bounds:
# the layer files as they are (the same format), per stage s `mp_rank_{s:02d}_model_states.pt`
# (DeepSpeed's stage parameter names and order; at ZeRO 0 the torch optimizer state over them), and at
# ZeRO 1 the stage's flat partitions per data-parallel rank, cut by the data-parallel writer
# (Note [DeepSpeed's partitions] in deepspeed_export.py). A tag saved at ZeRO 1/2 (per-rank flat
# files) is first read back into the per-layer masters and states of ZeRO 0 by the `pieces` map its
# flat files record (`read_flat_layer_optim`). fp32 only; interleaved tags (chunks > 1) are refused.


def is_zerospeed_pipeline_tag(tag_dir: Path) -> bool:
    """A tag zerospeed's PipelineEngine saved (parallel/pipeline/checkpoint.py)."""
    tag_dir = Path(tag_dir)
    return (tag_dir / "engine_states.pt").exists() and any(tag_dir.glob("layer_*-model_states.pt"))


def pipeline_tag_dir(checkpoint_dir, tag: str | None = None) -> Path | None:
    """The zerospeed pipeline tag `checkpoint_dir` (or its `tag`, or the one `latest` names) is, or None."""
    root = Path(checkpoint_dir)
    if tag is None and is_zerospeed_pipeline_tag(root):
        return root
    if tag is None and (root / "latest").exists():
        tag = (root / "latest").read_text().strip()
    return root / tag if tag is not None and is_zerospeed_pipeline_tag(root / tag) else None


def export_pipeline_to_deepspeed(
    checkpoint_dir, output_dir, *, stage: int, dp: int, tag: str | None = None, output_tag: str | None = None
) -> Path:
    """Note [pipeline export]: write the zerospeed pipeline checkpoint as DeepSpeed 0.19.8's pipeline tag for
    ZeRO `stage` (0 or 1) on `dp` data-parallel ranks per stage in `output_dir` (tag `output_tag`, by default
    the same name), with `latest`. Returns the tag directory written."""
    if stage not in (0, 1) or dp < 1:
        raise ValueError(f"export of a pipeline checkpoint: DeepSpeed's pipeline runs ZeRO 0 or 1, got {stage}")
    src_dir, layers, sources = _pipeline_sources(checkpoint_dir, tag)
    out_tag = output_tag or src_dir.name
    root, staging = staging_dir(output_dir, out_tag)
    for idx, state in layers.items():
        torch.save(state, staging / layer_file(idx))
    for s, src in enumerate(sources):
        states = _stage_states(src, stage, dp, len(sources))
        _save(states, staging / stage_file(s))
        for d in range(dp if stage == 1 else 0):
            osd = _stage12_optim(src, 1, dp, d)
            _save(
                {"optimizer_state_dict": osd, "ds_config": states["ds_config"], "ds_version": DS_LAYOUT_VERSION},
                staging / optim_file(d, s),
            )
    return publish_tag(root, staging, out_tag)


def export_pipeline_universal(
    checkpoint_dir, output_dir, *, dp: int = 1, tag: str | None = None, output_tag: str | None = None
) -> Path:
    """Note [DeepSpeed pipeline universal folders]: write the zerospeed pipeline checkpoint (ZeRO 0, as for
    `export_pipeline_to_deepspeed`) as the universal folder DeepSpeed's `ds_to_universal` makes of a ZeRO-1
    pipeline tag on `dp` data-parallel ranks per stage: `output_dir/<tag>_universal` (or `output_tag`) with
    `latest_universal`. DeepSpeed's PipelineEngine (and zerospeed's) loads it with `checkpoint.load_universal:
    true`. Returns the folder written."""
    if dp < 1:
        raise ValueError(f"export of a pipeline universal folder: dp must be at least 1, got {dp}")
    src_dir, _, sources = _pipeline_sources(checkpoint_dir, tag)
    out_tag = output_tag or f"{src_dir.name}_universal"
    root, staging = staging_dir(output_dir, out_tag)
    for s, src in enumerate(sources):
        _save(_stage_states(src, 1, dp, len(sources)), staging / stage_file(s))
    # (ds_to_universal keeps stage 0's rank-0 optimizer file)
    write_pipeline_universal_zero(staging, sources, sources[0], dp, cat_dim=lambda name: 0)
    return publish_tag(root, staging, out_tag, latest="latest_universal")


def write_pipeline_universal_zero(
    staging: Path, sources: list[ExportSource], first_rank: ExportSource, dp: int, cat_dim: Callable[[str], int | None]
) -> None:
    """A pipeline universal folder's `zero/`: `zero/<name>/` per parameter of the stages' `sources` (a tied module
    once; `cat_dim(name)` recorded where not None) and `zero/optimizer_state.pt` from the ZeRO-1 optimizer file of
    `first_rank` (stage 0's source as the first mp rank holds it) at data-parallel rank 0 of `dp`."""
    for src in sources:
        for name in src.group_names[0]:
            folder = staging / "zero" / name
            if folder.exists():  # a tied module: one folder for all its stages
                continue
            folder.mkdir(parents=True)
            dim = cat_dim(name)
            for key, value in src.universal.tensors[name].items():
                record = {"param": value.detach().clone()}
                if dim is not None:
                    record = {"cat_dim": dim, **record}
                _save(record, folder / f"{key}.pt")
            if "step" in src.universal.scalars.get(name, {}):
                _save(_own(src.universal.scalars[name]["step"]), folder / "step.pt")
    optimizer = _stage12_optim(first_rank, 1, dp, 0)
    for sharded in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups"):
        optimizer.pop(sharded)
    optimizer["param_groups"] = [_hyper(sources[0], 0, [0])]
    _save(optimizer, staging / "zero" / "optimizer_state.pt")


def _pipeline_sources(
    checkpoint_dir, tag: str | None, tp: bool = False, optim: dict | None = None
) -> tuple[Path, dict, list[ExportSource]]:
    """The zerospeed pipeline tag's layer files and, per stage at its saved bounds, the stage's parameters under
    DeepSpeed's names (Note [pipeline export]); full tensors. `tp`: a tag saved with tp is read too (its caller
    cuts it: deepspeed_pipeline_tp.py); `optim`: the per-layer masters and states already read (as
    `read_flat_layer_optim` gives them)."""
    src_dir = pipeline_tag_dir(checkpoint_dir, tag)
    if src_dir is None:
        raise CheckpointError(f"{checkpoint_dir}: no zerospeed pipeline checkpoint (engine_states.pt + layer files)")
    saved = torch.load(src_dir / "engine_states.pt", map_location="cpu", weights_only=False)
    layout = saved["layout"]
    if (
        layout.get("zero_stage") not in (0, 1, 2)
        or layout.get("chunks", 1) != 1
        or (layout.get("tp", 1) != 1 and not tp)
    ):
        raise CheckpointError(
            f"{src_dir}: saved with ZeRO stage {layout.get('zero_stage')}, {layout.get('chunks')} chunks, tp "
            f"{layout.get('tp')}; a pipeline checkpoint exports to DeepSpeed from ZeRO stage 0-2 without "
            "interleaving or tensor parallelism (resume it at ZeRO 0 and save again)"
        )
    if "tied_layers" not in saved:
        raise CheckpointError(
            f"{src_dir}/engine_states.pt records no tied layers (saved by an older zerospeed); load it into the "
            "pipeline engine and save it again to export it"
        )
    tied = {int(k): v for k, v in saved["tied_layers"].items()}
    layers = {}
    for idx in range(layout["num_layers"]):
        if (src_dir / layer_file(idx)).exists():
            layers[idx] = torch.load(src_dir / layer_file(idx), map_location="cpu", weights_only=True)
    if optim is None and layout["zero_stage"] != 0:
        optim = read_flat_layer_optim(src_dir, layout)
    elif optim is None:  # (ZeRO 0: the per-layer optimizer files)
        optim = {}
        for idx in range(layout["num_layers"]):
            if (path := src_dir / f"layer_{idx:02d}-optim_states.pt").exists():
                optim[idx] = torch.load(path, map_location="cpu", weights_only=False)
    if any(t.dtype != torch.float32 for s in layers.values() for t in s.values() if t.is_floating_point()):
        raise CheckpointError(f"{src_dir}: export of a pipeline checkpoint to DeepSpeed is written for fp32 weights")
    bounds, pp = layout["bounds"], layout["pp"]
    sources = []
    for s in range(pp):
        names, buffers, uni = [], [], UniversalState()
        held = range(bounds[s], bounds[s + 1])
        for key in dict.fromkeys(tied[i] for i in held if i in tied):
            idx = next(i for i in held if tied.get(i) == key)
            names += _stage_entries(uni, optim, layers, idx, f"{TIED}{key}.", buffers)
        for idx in held:
            if idx not in tied and idx in layers:
                names += _stage_entries(uni, optim, layers, idx, f"{idx}.", buffers)
        meta = {k: saved.get(k) for k in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")}
        meta.update(ds_config=saved.get("ds_config") or {}, loss_scaler=saved.get("loss_scaler"))
        sources.append(
            ExportSource(
                universal=uni,
                group_names=[names],
                param_groups=list(saved["param_groups"] or [{}])[:1],
                module={},
                module_keys=[],
                buffer_names=buffers,
                tied={},
                param_dtype=torch.float32,
                meta=meta,
                client_state=dict(saved.get("client_state") or {}),
            )
        )
    return src_dir, layers, sources


def read_flat_layer_optim(src_dir: Path, layout: dict, tp_rank: int | None = None) -> dict[int, dict]:
    """Note [pipeline export]: the ZeRO-1/2 flat files `zero_pp_rank_{s}_dp_rank_{d}_optim_states.pt` of a
    zerospeed pipeline tag as the per-layer optimizer files of ZeRO 0 hold them: {layer index: {name: {"master":
    full fp32 master, "state": its optimizer state}}}, each flat master's pieces put back by the file's `pieces`
    map (where each element belongs). `tp_rank`: that tp rank's files (`..._mp_rank_TT_...`) of a tag saved with
    tp, its local tensors, each entry with the `tp_layout` its pieces record (deepspeed_pipeline_tp.py joins)."""
    out: dict[int, dict] = {}
    filled: dict[tuple[int, str], int] = {}
    for s in range(layout["pp"]):
        for d in range(layout["dp"]):
            mp = "" if tp_rank is None else f"_mp_rank_{tp_rank:02d}"
            path = src_dir / f"zero_pp_rank_{s}_dp_rank_{d}{mp}_optim_states.pt"
            if not path.exists():
                raise CheckpointError(f"{path}: missing; a ZeRO-{layout['zero_stage']} pipeline tag is incomplete")
            flat = torch.load(path, map_location="cpu", weights_only=False)
            tp_less = tp_rank is not None and any("tp_layout" not in p for ps in flat.get("pieces", []) for p in ps)
            if "pieces" not in flat or tp_less:
                what = "tp layout of its parameter pieces" if tp_less else "parameter pieces"
                raise CheckpointError(
                    f"{path}: records no {what} (saved by an older zerospeed); load the checkpoint into "
                    "the pipeline engine and save it again to export it"
                )
            states = flat["optimizer"]["state"]
            for i, (master, pieces) in enumerate(zip(flat["masters"], flat["pieces"])):
                state = states.get(i, {})
                for piece in pieces:
                    for idx, name in piece["where"]:
                        entry = out.setdefault(idx, {}).get(name)
                        if entry is None:
                            shape = torch.Size(piece["shape"])
                            entry = out[idx][name] = {
                                "master": torch.zeros(shape, dtype=torch.float32),
                                "state": {
                                    k: torch.zeros(shape, dtype=v.dtype)
                                    if torch.is_tensor(v) and v.shape == master.shape
                                    else v
                                    for k, v in state.items()
                                },
                            }
                            if tp_rank is not None:
                                entry["tp_layout"] = piece["tp_layout"]
                        lo, hi, n = piece["offset"], piece["param_offset"], piece["numel"]
                        entry["master"].view(-1)[hi : hi + n] = master.view(-1)[lo : lo + n]
                        for k, v in state.items():
                            if torch.is_tensor(v) and v.shape == master.shape:
                                entry["state"][k].view(-1)[hi : hi + n] = v.view(-1)[lo : lo + n]
                        filled[(idx, name)] = filled.get((idx, name), 0) + n
    for idx, entries in out.items():
        for name, entry in entries.items():
            if filled[(idx, name)] != entry["master"].numel():
                raise CheckpointError(
                    f"{src_dir}: the flat optimizer files cover {filled[(idx, name)]} of the "
                    f"{entry['master'].numel()} elements of layer {idx}'s {name}; the tag is incomplete"
                )
    return out


def _stage_states(src: ExportSource, stage: int, dp: int, pp: int) -> dict:
    """A stage's `mp_rank_{s:02d}_model_states.pt` as DeepSpeed's PipelineEngine writes it."""
    states = _model_states(src, stage, dp)
    states.pop("universal_checkpoint_info", None)  # (DeepSpeed's pipeline writes none)
    states.update(module=None, mp_world_size=pp, checkpoint_parallel_dimensions={"pp_degree": pp, "tp_degree": 1})
    if stage == 1:
        states["shared_params"] = {}
    return states


def _stage_entries(uni, optim, layers, idx, prefix, buffers) -> list[str]:
    """Layer `idx`'s trainable parameters under DeepSpeed's stage names (`prefix` + name, in the layer's order)
    into `uni`; its other state-dict entries are buffers."""
    names, entries = [], optim.get(idx, {})  # (no optimizer file: a layer without trainable parameters)
    for k in layers[idx]:
        if k not in entries:
            buffers.append(prefix + k)
            continue
        master = entries[k]["master"].float()
        state = entries[k]["state"]
        uni.tensors[prefix + k] = {
            FP32: master,
            **{n: v for n, v in state.items() if torch.is_tensor(v) and v.shape == master.shape},
        }
        uni.scalars[prefix + k] = {n: v for n, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}
        uni.groups[prefix + k] = 0
        names.append(prefix + k)
    return names
