"""DeepSpeed's AutoEP checkpoints at ZeRO 1/2: reading a tag DeepSpeed 0.19.8 saved from a transformers MoE model
under `"expert_parallel"` at ZeRO stage 1 or 2 (Note [DeepSpeed AutoEP ZeRO-1/2 checkpoints]).

Note [DeepSpeed AutoEP ZeRO-1/2 checkpoints]: the tag holds `mp_rank_00_model_states.pt` (the dense weights, the
router under `mlp.router.gate.weight`, `param_shapes`: the dense group, then the expert group `w1`, `w2`, `w3` under
one rank's local shapes [E/ep, ...]; `ds_autoep_layers` with checkpoint_format `per_expert_files`),
`layer_{l}_expert_{e}_mp_rank_00_model_states.pt` (each global expert's weights; not needed: the optimizer files
hold the fp32 masters) and per rank `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (ZeRO 1/2's flat partitions, the
same at ZeRO 1 and 2: the dense group over all dp ranks, the expert group, `moe: True`, over the rank's
expert-data-parallel group). DeepSpeed's default groups (use_data_before_expert_parallel_ false) give rank r the ep
rank r % ep and the expert-data-parallel group r % ep, r % ep + ep, ... in rank order, as its native MoE does:
deepspeed_import's `stage12_universal` joins each ep rank's local experts from those ranks' fragments (a `rename`
keeps them apart), they are stacked in ep order to [E, ...], and deepspeed_autoep.autoep_checkpoint renames them to
transformers' names. Read: fp32 and bf16 runs (a bf16 run's files are `bf16_zero_pp_rank_*`: the same partitions,
fp32 masters), one dense and one expert param group, one ep size; anything else (fp16 among it) is refused naming
the tag. Tested on the autoep_zero2_ep2, autoep_zero1_ep2 and autoep_zero2_ep2_bf16 fixtures (2 ranks, ep 2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerospeed.checkpoint.deepspeed_autoep import (
    autoep_checkpoint,
    autoep_ep_size,
    autoep_format,
    read_autoep_model,
)
from zerospeed.checkpoint.deepspeed_import import (
    MODEL,
    DeepSpeedCheckpoint,
    _optim_files,
    _scalars,
    optim_prefix,
    stage12_universal,
)
from zerospeed.checkpoint.errors import CheckpointError
from zerospeed.checkpoint.universal import FP32


def is_deepspeed_autoep_zero12_tag(tag_dir: Path) -> bool:
    """A ZeRO-1/2 tag DeepSpeed's AutoEP saved (model states with per-expert-file `ds_autoep_layers`, ZeRO 1/2
    optimizer files)."""
    tag_dir = Path(tag_dir)
    path = tag_dir / MODEL
    if optim_prefix(tag_dir) is None or (tag_dir / "zero").is_dir():
        return False
    return autoep_format(path) == "per_expert_files"


def read_deepspeed_autoep_zero12_checkpoint(
    tag_dir: Path, names: set[str] | None = None, group_names: list[list[str]] | None = None
) -> DeepSpeedCheckpoint:
    """The universal form (transformers' names, whole [E, ...] experts) of a DeepSpeed AutoEP ZeRO-1/2 tag."""
    del group_names  # (the tag names its parameters)
    tag_dir = Path(tag_dir)
    model, dp, ds_config = read_autoep_model(tag_dir, MODEL)
    if isinstance(ds_config.get("fp16"), dict) and ds_config["fp16"].get("enabled"):
        raise CheckpointError(f"{tag_dir}: a fp16 DeepSpeed AutoEP checkpoint is not read here; fp32 and bf16 runs are")
    if ds_config.get("use_data_before_expert_parallel_"):
        raise CheckpointError(
            f"{tag_dir}: use_data_before_expert_parallel_ places DeepSpeed's expert-data-parallel groups "
            "differently; such an AutoEP checkpoint is not read here"
        )
    ep = autoep_ep_size(tag_dir, model)
    ranks = _optim_files(tag_dir, dp)  # (a bf16 run's `bf16_zero_pp_rank_*`: optim_prefix)
    base = ranks[0]["base_optimizer_state"]
    moe = [bool(g.get("moe")) for g in base["param_groups"]]
    if "single_partition_of_fp32_groups" not in ranks[0] or moe != [False, True] or len(model["param_shapes"]) != 2:
        raise CheckpointError(
            f"{tag_dir}: AutoEP ZeRO-1/2 optimizer files with param groups moe={moe}; only one dense and one "
            "expert group of ZeRO 1/2 partitions (single_partition_of_fp32_groups) are read here"
        )
    if [int(c) for c in ranks[0]["partition_count"]] != [dp, dp // ep]:
        raise CheckpointError(
            f"{tag_dir}: partition_count {ranks[0]['partition_count']}, expected [{dp}, {dp // ep}] for {dp} ranks "
            f"at ep {ep}"
        )
    dense, local = (dict(g) for g in model["param_shapes"])
    shapes = [dense, {f"{n}@{e}": s for e in range(ep) for n, s in local.items()}]

    def rename(name: str, rank: int, gi: int) -> str:  # rank r holds ep rank r % ep's experts
        return f"{name}@{rank % ep}" if gi == 1 else name

    uni = stage12_universal(tag_dir, ranks, shapes, None, rename)
    tensors = {n: {k: v.view(s) for k, v in uni.tensors[n].items()} for n, s in dense.items()}
    for name, shape in local.items():
        per_ep = [uni.tensors[f"{name}@{e}"] for e in range(ep)]
        tensors[name] = {k: torch.cat([p[k].view(shape) for p in per_ep]) for k in per_ep[0]}
    if set(tensors[next(iter(local))]) != set(tensors[next(iter(dense))]) or FP32 not in tensors[next(iter(dense))]:
        raise CheckpointError(f"{tag_dir}: the dense and expert groups hold different optimizer states")
    scalars = [_scalars(base["state"].get(g, {})) for g in (0, 1)]
    return autoep_checkpoint(
        tag_dir,
        int(ranks[0].get("zero_stage", 1)),
        dp,
        model,
        tensors,
        scalars,
        base["param_groups"],
        ranks[0].get("loss_scaler"),
        names,
    )
