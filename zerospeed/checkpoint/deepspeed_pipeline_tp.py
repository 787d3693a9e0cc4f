"""DeepSpeed pipeline checkpoints with Megatron-style tensor parallelism inside the stages: read into full
tensors, and each loading rank's piece cut from them.

Note [DeepSpeed pipeline checkpoints with tp]: DeepSpeed 0.19.8's PipelineEngine on a
`PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` (axes pipe, data, model) writes, besides what Note
[DeepSpeed pipeline checkpoints] (deepspeed_pipeline.py) describes:
- per layer and tp rank t, `layer_{i:02d}-model_{t:02d}-model_states.pt` (the topology's rank string without the
  pipe and data axes), the layer's state dict of rank t's *local* tensors, written by data-parallel rank 0;
- per stage s and tp rank t `mp_rank_{s * tp + t:02d}_model_states.pt`: the engine's mp rank is the grid's
  "model parallel" rank, the index of the rank among those of its data-parallel index (pipe x model), so
  `mp_world_size` is pp * tp and `checkpoint_parallel_dimensions` records both degrees; at ZeRO 0 it holds the
  torch optimizer's state over rank t's local tensors of the stage, at ZeRO 1 data-parallel rank d writes
  `zero_pp_rank_{d}_mp_rank_{s * tp + t:02d}_optim_states.pt`.
So tp rank t's files are a pipeline checkpoint of its own local tensors (`read_deepspeed_pipeline(tp=, tp_rank=)`
reads one). How the local tensors make the full one is only known from the `universal_checkpoint_info` the run
saved (Megatron-DeepSpeed's GPTModelPipe sets it; a client_state key works too): its name categories (Note
[DeepSpeed tensor-parallel checkpoints] in deepspeed_tp.py, `join`) over the stage-module names ("{layer}.{name}",
"tied_modules.{key}.{name}"). The ranks are joined into full tensors (weights, fp32 masters, Adam's moments; the
scalars and buffers are tp rank 0's), so the tag loads at any stage count, tp degree and data-parallel size.
A loading rank of a tp > 1 run takes its piece: zerospeed's tensor-parallel layers by their own shard layouts,
plain layers holding local tensors (DeepSpeed-style Megatron layers) by the same categories (`tp_piece`, the
inverse of `join`): replicated and averaged parameters whole, row-parallel ones split along dim 1, the rest
along dim 0 (two fused halves each split).
DeepSpeed's `ds_to_universal` folder of such a (ZeRO-1) tag holds the full tensors already (`zero/<name>/`) and a
stage file per (stage, tp rank) with that rank's local `param_shapes` and the info: read from tp rank 0's stage
files at the full shapes (`read_deepspeed_pipeline_universal_tp`) and cut the same way.
Refused, naming the file: no `universal_checkpoint_info`, an affine map or vocabulary padding where a tp > 1 plain
layer needs its piece (only the categories are re-cut).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_export import (
    DS_LAYOUT_VERSION,
    ExportSource,
    _save,
    _stage12_optim,
    publish_tag,
    staging_dir,
)
from zerospeed.checkpoint.deepspeed_import import _load, _universal_shape
from zerospeed.checkpoint.deepspeed_pipeline import (
    TIED,
    DeepSpeedPipeline,
    _pipeline_sources,
    _stage_states,
    _value,
    optim_file,
    pipeline_tag_dir,
    read_deepspeed_pipeline,
    read_deepspeed_pipeline_universal,
    read_flat_layer_optim,
    stage_file,
    write_pipeline_universal_zero,
)
from zerospeed.checkpoint.deepspeed_tp import _matches, _uc_info, join
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.tensor_parallel import TPLayout, assemble_full, reslice
from zerospeed.checkpoint.universal import FP32, UniversalState

INFO = "universal_checkpoint_info"


def tp_layer_file(idx: int, tp_rank: int) -> str:
    """DeepSpeed's layer file of tp rank `tp_rank` (Note [DeepSpeed pipeline checkpoints with tp])."""
    return f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"


def is_deepspeed_pipeline_tp_tag(tag_dir: Path) -> bool:
    """A DeepSpeed pipeline tag saved with tensor parallelism inside its stages (per-tp-rank layer files)."""
    tag_dir = Path(tag_dir)
    return not (tag_dir / "engine_states.pt").exists() and any(tag_dir.glob("layer_*-model_*-model_states.pt"))


def tp_degree(tag_dir: Path, first: dict) -> int:
    """The tag's tp degree: recorded by DeepSpeed >= 0.19 (`checkpoint_parallel_dimensions`), else counted."""
    dims = first.get("checkpoint_parallel_dimensions") or {}
    if dims.get("tp_degree"):
        return int(dims["tp_degree"])
    return len({f.name.split("-")[1] for f in Path(tag_dir).glob("layer_*-model_*-model_states.pt")})


def read_deepspeed_pipeline_tp(tag_dir: Path, tied: dict[int, str] | None = None, bounds=None) -> DeepSpeedPipeline:
    """Note [DeepSpeed pipeline checkpoints with tp]: the tag with full tensors (layers, masters, optimizer
    states), as `read_deepspeed_pipeline` gives for a tag without tp; `meta` also holds `tp` (the saved degree)
    and the `universal_checkpoint_info` (`tp_piece` cuts by it)."""
    tag_dir = Path(tag_dir)
    first = _load(tag_dir / stage_file(0))
    info = _uc_info(tag_dir, first)
    tp, tied = tp_degree(tag_dir, first), dict(tied or {})
    ranks = [read_deepspeed_pipeline(tag_dir, tied, bounds, tp=tp, tp_rank=t) for t in range(tp)]
    uni = UniversalState()
    for name, keys in ranks[0].universal.tensors.items():
        shapes = [_value(name, r.layers, tied, tag_dir).shape for r in ranks]
        uni.tensors[name] = {
            key: join(info, name, [r.universal.tensors[name][key].view(s) for r, s in zip(ranks, shapes)], key, tag_dir)
            for key in keys
        }
        uni.scalars[name], uni.groups[name] = ranks[0].universal.scalars[name], 0
    layers = {}
    for idx, state in ranks[0].layers.items():
        prefix = f"{TIED}{tied[idx]}." if idx in tied else f"{idx}."
        layers[idx] = {  # (buffers and frozen weights are not split: tp rank 0's)
            k: join(info, prefix + k, [r.layers[idx][k] for r in ranks], FP32, tag_dir)
            if prefix + k in uni.tensors
            else v
            for k, v in state.items()
        }
    full_shapes = {n: t[FP32].shape for n, t in uni.tensors.items()}
    for tensors in uni.tensors.values():
        tensors.update({k: v.reshape(-1) for k, v in tensors.items()})  # (flat, as the universal form holds them)
    out = ranks[0]
    out.universal, out.layers = uni, layers
    out.meta.update(tp=tp, shapes={n: tuple(shape) for n, shape in full_shapes.items()}, **{INFO: info})
    return out


def read_deepspeed_pipeline_universal_tp(tag_dir: Path) -> DeepSpeedPipeline:
    """A universal folder DeepSpeed's `ds_to_universal` made of a pipeline tag with tp inside the stages (its
    `zero/<name>/` tensors full, per (stage, tp rank) a stage file of local shapes): as
    `read_deepspeed_pipeline_tp` gives (no layer files: the weights are the fp32 tensors)."""
    tag_dir = Path(tag_dir)
    first = _load(tag_dir / stage_file(0))
    info, tp = _uc_info(tag_dir, first), _tp_degree_of(first)
    out = read_deepspeed_pipeline_universal(tag_dir, tp=tp)
    shapes = {n: _universal_shape(tag_dir, n) for n in out.universal.tensors}
    out.meta.update(tp=tp, shapes=shapes, **{INFO: info})
    return out


def universal_tp_degree(tag_dir: Path) -> int:
    """The tp degree a pipeline universal folder was converted at (its stage files' record; 1 if none)."""
    return _tp_degree_of(_load(Path(tag_dir) / stage_file(0)))


def _tp_degree_of(stage_states: dict) -> int:
    dims = stage_states.get("checkpoint_parallel_dimensions") or {}
    return int(dims.get("tp_degree") or 1)


def tp_piece(info: dict, name: str, full: torch.Tensor, tp: int, rank: int, where: Path) -> torch.Tensor:
    """Tp rank `rank` of `tp`'s local tensor of `name` (a DeepSpeed stage-module name) from its full tensor, by
    the checkpoint's name categories (the inverse of deepspeed_tp.join)."""
    if tp == 1 or _matches(info.get("tp_replicated_parameter_patterns"), name):
        return full
    if _matches(info.get("parameter_to_average_patterns"), name):
        return full
    refused = (info.get("affine_map") or {}).get("params") or {}
    if any(_matches([p], name) for p in refused) or _matches(info.get("vocabulary_parameter_patterns"), name):
        raise CheckpointError(
            f"{where / stage_file(0)}: {name} is split by an affine map or padded to a vocabulary size in "
            f"universal_checkpoint_info; a plain layer's tp {tp} piece is cut by the name categories only (load "
            "it at the saved tp degree into zerospeed's tensor-parallel layers, or at tp 1)"
        )
    if _matches(info.get("parameter_with_row_parallelism_patterns"), name):
        return _chunk(full, tp, rank, 1, name, where)
    if _matches(info.get("parameter_with_2_sub_params_cat_dim_0"), name):
        halves = full.chunk(2, dim=0)
        return torch.cat([_chunk(h, tp, rank, 0, name, where) for h in halves], dim=0)
    return _chunk(full, tp, rank, 0, name, where)


def _chunk(full: torch.Tensor, tp: int, rank: int, dim: int, name: str, where: Path) -> torch.Tensor:
    if full.dim() <= dim or full.shape[dim] % tp:
        raise CheckpointError(
            f"{where}: {name} of shape {tuple(full.shape)} does not split evenly along dim {dim} into {tp} tp pieces"
        )
    return full.chunk(tp, dim=dim)[rank].contiguous()


# ---- export: a zerospeed pipeline checkpoint saved with tp as DeepSpeed's pipeline tag with tp ---------------

# Note [pipeline export with tp]: a zerospeed PipelineEngine checkpoint saved with tensor parallelism holds full
# tensors per layer (Note [full-layout layer files] in parallel/pipeline/checkpoint.py) and each parameter's tp split
# (`tp_layout`, the layer's shard layouts): at ZeRO 0 in its per-layer optimizer files (full masters and states), at
# ZeRO 1/2 in the `pieces` of its per-(stage, dp rank, tp rank) flat files, whose local masters and states are read
# per tp rank (`read_flat_layer_optim(tp_rank=)`) and joined by the splits into the full ones. It is written as the
# tag DeepSpeed's PipelineEngine saves on PipeModelDataParallelTopology(pp, tp, dp) (Note [DeepSpeed pipeline
# checkpoints with tp]) at the saved stage bounds and tp degree: per tp rank t its pieces of every layer file, stage
# file and (ZeRO 1) optimizer partition, as the data-parallel export writes them for a tag of rank t's local tensors
# (Note [pipeline export]); every stage file records `universal_checkpoint_info` with Megatron's categories
# (row-parallel: split along dim 1; replicated; the rest along dim 0), so DeepSpeed's ds_to_universal and zerospeed's
# import rebuild the full tensors. `--to universal` writes the folder ds_to_universal makes of such a ZeRO-1 tag:
# `zero/<name>/` full tensors (`cat_dim` the split's dim; none for a replicated parameter), per (stage, tp rank) the
# ZeRO-1 stage file of rank t's local shapes, and `zero/optimizer_state.pt` of stage 0, tp rank 0, dp rank 0.
# DeepSpeed's model must hold each rank's even, contiguous piece of the same full layers (Megatron's split); uneven,
# fused or replicated-head splits have no category and are refused, and so are saves older than the `tp_layout`
# records (load and save again).


def export_pipeline_tp_to_deepspeed(
    checkpoint_dir, output_dir, *, stage: int, dp: int, tag: str | None = None, output_tag: str | None = None
) -> Path:
    """Note [pipeline export with tp]: the zerospeed pipeline checkpoint saved with tp as DeepSpeed 0.19.8's
    pipeline tag for ZeRO `stage` (0 or 1) on `dp` data-parallel ranks per (stage, tp rank), in `output_dir`
    (tag `output_tag`, by default the same name), with `latest`. Returns the tag directory written."""
    if stage not in (0, 1) or dp < 1:
        raise ValueError(f"export of a pipeline checkpoint: DeepSpeed's pipeline runs ZeRO 0 or 1, got {stage}")
    src = _TPSource.read(checkpoint_dir, tag)
    out_tag = output_tag or src.dir.name
    root, staging = staging_dir(output_dir, out_tag)
    for t in range(src.tp):
        for idx, state in src.layers.items():
            prefix = f"{TIED}{src.tied[idx]}." if idx in src.tied else f"{idx}."
            piece = {k: reslice(v, src.splits.get(prefix + k), t).clone() for k, v in state.items()}
            torch.save(piece, staging / tp_layer_file(idx, t))
        for s in range(src.pp):
            local, states = src.stage_states(s, t, stage, dp)
            _save(states, staging / stage_file(s * src.tp + t))
            for d in range(dp if stage == 1 else 0):
                osd = _stage12_optim(local, 1, dp, d)
                _save(
                    {"optimizer_state_dict": osd, "ds_config": states["ds_config"], "ds_version": DS_LAYOUT_VERSION},
                    staging / optim_file(d, s * src.tp + t),
                )
    return publish_tag(root, staging, out_tag)


def export_pipeline_universal_tp(
    checkpoint_dir, output_dir, *, dp: int = 1, tag: str | None = None, output_tag: str | None = None
) -> Path:
    """Note [pipeline export with tp]: the zerospeed pipeline checkpoint saved with tp as the universal folder
    DeepSpeed's `ds_to_universal` makes of its ZeRO-1 pipeline tag on `dp` data-parallel ranks per (stage, tp rank):
    `output_dir/<tag>_universal` (or `output_tag`) with `latest_universal`. Returns the folder written."""
    if dp < 1:
        raise ValueError(f"export of a pipeline universal folder: dp must be at least 1, got {dp}")
    src = _TPSource.read(checkpoint_dir, tag)
    out_tag = output_tag or f"{src.dir.name}_universal"
    root, staging = staging_dir(output_dir, out_tag)
    for t in range(src.tp):
        for s in range(src.pp):
            _save(src.stage_states(s, t, 1, dp)[1], staging / stage_file(s * src.tp + t))

    def cat_dim(name: str) -> int | None:  # (ds_to_universal records the dim of a split parameter only)
        split = src.splits.get(name)
        return None if split is None else split.specs[0].dim

    # (ds_to_universal keeps mp rank 0's dp-rank-0 optimizer file)
    write_pipeline_universal_zero(staging, src.sources, src.local(0, 0), dp, cat_dim)
    return publish_tag(root, staging, out_tag, latest="latest_universal")


@dataclass
class _TPSource:
    """A zerospeed pipeline tag saved with tp, read for the export: full layers and per-stage sources, each split
    parameter's layout (by DeepSpeed name) and the universal_checkpoint_info naming them."""

    dir: Path
    tp: int
    pp: int
    tied: dict[int, str]
    layers: dict
    sources: list[ExportSource]
    splits: dict[str, TPLayout]
    info: dict

    @classmethod
    def read(cls, checkpoint_dir, tag: str | None) -> _TPSource:
        src_dir = pipeline_tag_dir(checkpoint_dir, tag)
        if src_dir is None:
            raise CheckpointError(
                f"{checkpoint_dir}: no zerospeed pipeline checkpoint (engine_states.pt + layer files)"
            )
        saved = torch.load(src_dir / "engine_states.pt", map_location="cpu", weights_only=False)
        layout, tied = saved["layout"], {int(k): v for k, v in saved.get("tied_layers", {}).items()}
        optim = _saved_optim(src_dir, layout)
        _, layers, sources = _pipeline_sources(checkpoint_dir, tag, tp=True, optim=optim)
        splits = _saved_splits(optim, tied)
        info = _categories(splits, [n for src in sources for n in src.group_names[0]], src_dir)
        return cls(src_dir, int(layout.get("tp", 1)), int(layout["pp"]), tied, layers, sources, splits, info)

    def local(self, s: int, t: int) -> ExportSource:
        """Stage s's export source with tp rank t's pieces of its tensors."""
        src, uni = self.sources[s], UniversalState()
        for name, tensors in src.universal.tensors.items():
            uni.tensors[name] = {k: reslice(v, self.splits.get(name), t).clone() for k, v in tensors.items()}
            uni.scalars[name], uni.groups[name] = src.universal.scalars[name], src.universal.groups[name]
        return replace(src, universal=uni)

    def stage_states(self, s: int, t: int, stage: int, dp: int) -> tuple[ExportSource, dict]:
        """(tp rank t's source of stage s, its `mp_rank_{s * tp + t:02d}_model_states.pt`) for ZeRO `stage`."""
        local = self.local(s, t)
        states = _stage_states(local, stage, dp, self.pp * self.tp)
        states.update(checkpoint_parallel_dimensions={"pp_degree": self.pp, "tp_degree": self.tp}, **{INFO: self.info})
        return local, states


def _saved_optim(src_dir: Path, layout: dict) -> dict[int, dict]:
    """{layer index: {name: {"master", "state", "tp_layout"}}} at full size: the per-layer optimizer files of a
    ZeRO-0 save, or the tp ranks' ZeRO-1/2 flat files joined by the splits their pieces record."""
    if layout.get("zero_stage") == 0:
        out = {}
        for path in sorted(src_dir.glob("layer_*-optim_states.pt")):
            out[int(path.name[len("layer_") :].split("-")[0])] = entries = torch.load(
                path, map_location="cpu", weights_only=False
            )
            for name, entry in entries.items():
                if "tp_layout" not in entry:
                    raise CheckpointError(
                        f"{path}: records no tp split of {name} (saved by an older zerospeed); load the checkpoint "
                        "into the pipeline engine and save it again to export it"
                    )
        return out
    ranks = [read_flat_layer_optim(src_dir, layout, tp_rank=t) for t in range(int(layout.get("tp", 1)))]
    out = {}
    for idx, entries in ranks[0].items():
        for name, entry in entries.items():
            split = None if entry["tp_layout"] is None else TPLayout.from_json(entry["tp_layout"])
            pieces = [r[idx][name] for r in ranks]
            state = {
                k: assemble_full({t: p["state"][k] for t, p in enumerate(pieces)}, split)
                if torch.is_tensor(v) and v.shape == entry["master"].shape
                else v
                for k, v in entry["state"].items()
            }
            master = assemble_full({t: p["master"] for t, p in enumerate(pieces)}, split)
            out.setdefault(idx, {})[name] = {"master": master, "state": state, "tp_layout": entry["tp_layout"]}
    return out


def _saved_splits(optim: dict[int, dict], tied: dict[int, str]) -> dict[str, TPLayout]:
    """{DeepSpeed name: the saved tp split} of every split parameter."""
    out = {}
    for idx, entries in optim.items():
        prefix = f"{TIED}{tied[idx]}." if idx in tied else f"{idx}."
        for name, entry in entries.items():
            if entry["tp_layout"] is not None:
                out[prefix + name] = TPLayout.from_json(entry["tp_layout"])
    return out


def _categories(splits: dict[str, TPLayout], names: list[str], src_dir: Path) -> dict:
    """DeepSpeed's universal_checkpoint_info for the splits (Megatron's name categories, one pattern a name)."""
    row = []
    for name, split in splits.items():
        even = all(
            s.replicas == 1
            and s.segments == ((r * s.local_size, s.local_size),)
            and s.full_size == s.local_size * split.tp
            for r, s in enumerate(split.specs)
        )
        if split.transposed or not even or split.specs[0].dim not in (0, 1):
            raise CheckpointError(
                f"{src_dir}: {name} is split unevenly, fused or transposed over tp; DeepSpeed's pipeline checkpoint "
                "names a split by Megatron's categories only (even, contiguous, along dim 0 or 1)"
            )
        if split.specs[0].dim == 1:
            row.append(name)
    return {
        "parameter_with_row_parallelism_patterns": [f"^{re.escape(n)}$" for n in row],
        "tp_replicated_parameter_patterns": [f"^{re.escape(n)}$" for n in dict.fromkeys(names) if n not in splits],
    }


def saved_with_tp(checkpoint_dir, tag: str | None = None) -> bool:
    """A zerospeed pipeline checkpoint saved with tensor parallelism inside its stages (Note [pipeline export with
    tp])."""
    src_dir = pipeline_tag_dir(checkpoint_dir, tag)
    if src_dir is None:
        return False
    saved = torch.load(src_dir / "engine_states.pt", map_location="cpu", weights_only=False)
    return int(saved["layout"].get("tp", 1)) > 1
