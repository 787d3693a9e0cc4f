"""Writing a zerospeed tensor-parallel checkpoint as DeepSpeed 0.19.8's AutoTP tag (`export --to deepspeed --tp T`).

Note [DeepSpeed's AutoTP split]: DeepSpeed's AutoTP (training, 0.19.8) splits a column-parallel Linear's
weight (and bias) into T equal row blocks, a row-parallel one's weight into T equal column blocks (its bias
whole on every rank), the output head into T vocabulary blocks, and leaves embeddings and norms whole on
every rank. zerospeed's AutoTP makes the same column / row choices for the layers both shard (its
`ShardSpec`s say which dimension), but also splits the input embedding over the vocabulary; so the
DeepSpeed split of each parameter is read from the checkpoint's own layouts: one contiguous block per rank
along dim 0 -> column (vocabulary for an `lm_head`), along dim 1 -> row, an embedding or an unsplit
parameter -> whole on every rank; a fused weight (q|k|v with a partition_config `shape`) whose ranks each
hold their block of every sub-parameter -> DeepSpeed's sub-parameter split (the same pieces, recorded as
`parameter_with_sub_params` and `sub_param_shard_widths`; at the saved tp only). Splits DeepSpeed lays out
otherwise are refused by name: transposed Conv1D weights (GPT-2's c_attn, which DeepSpeed 0.19.8's AutoTP
does not train), kv heads shared by several ranks, uneven blocks, and heads tied to the embedding.

Each tp rank t's tensors (weights, fp32 masters, Adam moments) then make a data-parallel DeepSpeed tag of
its own (Note [DeepSpeed's partitions] in deepspeed_export.py), written under tp rank t's names
(`mp_rank_{t:02d}_model_states.pt`, `zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`) with
`mp_world_size` T and the `universal_checkpoint_info` categories DeepSpeed's AutoTP records (so
`ds_to_universal` converts it). DeepSpeed's AutoTP trains at ZeRO 0-2; stage 3 is refused.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.deepspeed_export import (
    ExportSource,
    _bf16_optimizer_optim,
    _ds_config,
    _frozen_fragments,
    _model_states,
    _save,
    _stage12_optim,
    _uses_bf16_optimizer,
    publish_tag,
    read_zerospeed_source,
    stage_tag,
)
from zerospeed.checkpoint.deepspeed_import import BF16_PREFIX
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.manifest import saved_layouts
from zerospeed.checkpoint.tensor_parallel import Layouts
from zerospeed.checkpoint.universal import FP32, UniversalState

COLUMN, ROW, WHOLE = 0, 1, None  # the dimension DeepSpeed splits a parameter along (None: whole on every rank)
Split = int | tuple[int, ...] | None  # a dimension, the sizes of fused sub-parameters (each split along dim 0), None


def autotp_split(name: str, shape: list[int], layouts: Layouts, tp: int) -> Split:
    """How DeepSpeed's AutoTP splits `name`, from zerospeed's layout (Note above)."""
    layout = layouts.get(name)
    if layout is None or (len(shape) == 2 and "embed" in name):
        return WHOLE
    spec, saved = layout.specs[0], layout.tp
    sizes = _sub_param_sizes(layout)
    ok = not layout.transposed and spec.dim in (0, 1) and all(s.replicas == 1 for s in layout.specs)
    if ok and sizes is not None and len(sizes) == 1 and spec.full_size % tp == 0:
        return spec.dim
    if ok and sizes is not None and len(sizes) > 1 and spec.dim == 0 and saved == tp:
        return sizes
    raise CheckpointError(
        f"export to DeepSpeed at tp {tp}: parameter {name!r} is split in a way DeepSpeed's AutoTP lays out "
        "otherwise (a transposed Conv1D weight, kv heads shared by several ranks, uneven blocks, or fused "
        f"sub-parameters at another tp than the saved {saved}); export without --tp (DeepSpeed then loads it at tp 1)"
    )


def _sub_param_sizes(layout) -> tuple[int, ...] | None:
    """The sizes of the sub-parameters a layout cuts each into tp equal consecutive blocks (one sub-parameter:
    a plain even split), or None when it is not such a layout."""
    tp, first = layout.tp, layout.specs[0]
    starts = [a for a, _ in first.segments]
    sizes = [b - a for a, b in zip(starts, [*starts[1:], first.full_size])]
    for r, spec in enumerate(layout.specs):
        want = tuple((a + r * (n // tp), n // tp) for a, n in zip(starts, sizes))
        if spec.dim != first.dim or spec.segments != want or any(n % tp for n in sizes):
            return None
    return tuple(sizes) if starts and starts[0] == 0 else None


def _pattern(n: str) -> str:
    return "^" + re.escape(n) + "$"


def autotp_info(src: ExportSource, splits: dict[str, Split], tp: int) -> dict:
    """DeepSpeed's `universal_checkpoint_info` categories for the split (what its AutoTP records)."""
    names = [n for g in src.group_names for n in g] + src.frozen_names()
    vocab = [n for n in names if splits.get(n) == COLUMN and "lm_head" in n]
    fused = [n for n in names if isinstance(splits.get(n), tuple)]
    info = {
        "universal_checkpoint_version": 0.4,
        "parameter_with_row_parallelism_patterns": sorted(_pattern(n) for n in names if splits.get(n) == ROW),
        "tp_replicated_parameter_patterns": sorted(_pattern(n) for n in names if splits.get(n) is WHOLE),
        "vocabulary_parameter_patterns": sorted(_pattern(n) for n in vocab),
        "parameter_with_sub_params": [
            {
                "patterns": [_pattern(n)],
                "shape": [splits[n], -1] if src.universal.tensors[n][FP32].dim() == 2 else [splits[n]],
                "partition_dim": 0,
            }
            for n in fused
        ],
        "autotp_unsupported_parameter_patterns": {},
    }
    if fused:
        info["sub_param_shard_widths"] = {_pattern(n): [[size // tp] * tp for size in splits[n]] for n in fused}
    if vocab:
        info["original_vocab_size"] = int(src.universal.tensors[vocab[0]][FP32].shape[0])
    return info


def _piece(t: torch.Tensor, split: Split, tp: int, rank: int) -> torch.Tensor:
    if split is None:
        return t
    if isinstance(split, tuple):  # each fused sub-parameter's rank-th block, concatenated
        return torch.cat([sub.chunk(tp, dim=0)[rank] for sub in t.split(list(split), dim=0)]).contiguous()
    return t.chunk(tp, dim=split)[rank].contiguous()


def rank_source(src: ExportSource, splits: dict[str, Split], tp: int, rank: int) -> ExportSource:
    """`src` with every tensor cut to tp rank `rank`'s piece (its local tensors as DeepSpeed holds them)."""
    tensors = {
        n: {k: _piece(v, splits.get(n), tp, rank) for k, v in keys.items()} for n, keys in src.universal.tensors.items()
    }
    module = {n: _piece(v, splits.get(n), tp, rank) for n, v in src.module.items()}
    uni = UniversalState(tensors, src.universal.scalars, src.universal.groups)
    return dataclasses.replace(src, universal=uni, module=module)


def splits_from_layouts(src: ExportSource, layouts: Layouts, tp: int) -> dict[str, Split]:
    """{name: how DeepSpeed's AutoTP splits it} from zerospeed's layouts."""
    shapes = {n: list(v[FP32].shape) for n, v in src.universal.tensors.items()}
    shapes.update({n: list(v.shape) for n, v in src.module.items()})
    return {n: autotp_split(n, s, layouts, tp) for n, s in shapes.items()}


def splits_from_deepspeed(info: dict, names) -> dict[str, Split]:
    """{name: how it is split} from the `universal_checkpoint_info` categories DeepSpeed's AutoTP records."""

    def matches(key: str, name: str) -> bool:
        return any(re.match(p, name) for p in info.get(key) or ())

    def split(name: str) -> Split:
        for sub in info.get("parameter_with_sub_params") or ():
            if any(re.match(p, name) for p in sub["patterns"]):
                return tuple(sub["shape"][sub.get("partition_dim", 0)])
        if matches("tp_replicated_parameter_patterns", name):
            return WHOLE
        return ROW if matches("parameter_with_row_parallelism_patterns", name) else COLUMN

    return {n: split(n) for n in names}


def write_deepspeed_tp_tag(
    src: ExportSource, splits: dict[str, Split], out_dir, tag: str, *, stage: int, dp: int, tp: int
) -> Path:
    """Write `src` as DeepSpeed 0.19.8's AutoTP tag `out_dir/tag` for ZeRO `stage` on tp x dp ranks and point
    `out_dir/latest` at it (Note [DeepSpeed's AutoTP split]). Returns the tag directory."""
    if stage not in (0, 1, 2) or dp < 1 or tp < 2:
        raise ValueError(
            f"export to DeepSpeed with tensor parallelism: stage must be 0-2 (DeepSpeed's AutoTP stops at ZeRO 2), "
            f"dp >= 1 and tp >= 2; got stage {stage}, dp {dp}, tp {tp}"
        )
    if stage == 0 and src.param_dtype != torch.float32:
        raise CheckpointError(
            f"export to DeepSpeed at ZeRO stage 0 with {src.param_dtype} weights: export at stage 1 or 2"
        )
    if src.tied:
        raise CheckpointError(
            f"export to DeepSpeed at tp {tp}: tied parameters {sorted(src.tied)[:3]} (a head tied to the embedding): "
            "DeepSpeed's AutoTP splits the head and keeps the embedding whole; export without --tp"
        )
    info = autotp_info(src, splits, tp)
    root, staging, _ = stage_tag(src, out_dir, tag, None)
    bf16 = src.param_dtype == torch.bfloat16
    use_bf16 = stage == 1 and bf16 and _uses_bf16_optimizer(src)  # (DeepSpeed's BF16_Optimizer files)
    for t in range(tp):
        local = rank_source(src, splits, tp, t)
        states = _model_states(local, stage, dp, _frozen_fragments(local, stage, dp, 0))
        states.update(
            mp_world_size=tp,
            checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": tp},
            universal_checkpoint_info=info,
        )
        _save(states, staging / f"mp_rank_{t:02d}_model_states.pt")
        ds_config = _ds_config(local, stage)
        for r in range(dp if stage > 0 else 0):
            osd = _bf16_optimizer_optim(local, dp, r) if use_bf16 else _stage12_optim(local, stage, dp, r)
            _save(
                {"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": states["ds_version"]},
                staging / f"{BF16_PREFIX if bf16 else ''}zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt",
            )
    return publish_tag(root, staging, tag)


def export_to_deepspeed_tp(
    checkpoint_dir,
    output_dir,
    *,
    stage: int,
    dp: int,
    tp: int,
    tag: str | None = None,
    output_tag: str | None = None,
    group_names: list[list[str]] | None = None,
) -> Path:
    """Export a zerospeed checkpoint saved with tensor parallelism (at any tp degree) as DeepSpeed 0.19.8's AutoTP
    tag for ZeRO `stage` on tp x dp ranks (`"tensor_parallel": {"autotp_size": tp}`). Returns the tag directory
    written."""
    tag_dir, manifest = resolve_checkpoint(checkpoint_dir, tag)
    if int(manifest.get("parallel_layout", {}).get("tensor_parallel", 1)) < 2:
        raise CheckpointError(
            f"export to DeepSpeed at tp {tp}: {tag_dir} was saved without tensor parallelism, so it does not say "
            "which parameters are column or row parallel; resume it in zerospeed with tensor_parallel.autotp_size, "
            "save, and export that"
        )
    src = read_zerospeed_source(checkpoint_dir, tag, group_names)
    splits = splits_from_layouts(src, saved_layouts(manifest), tp)
    return write_deepspeed_tp_tag(src, splits, output_dir, output_tag or tag_dir.name, stage=stage, dp=dp, tp=tp)
