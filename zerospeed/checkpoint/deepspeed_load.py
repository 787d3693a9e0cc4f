"""`engine.load_checkpoint` of a checkpoint DeepSpeed saved (Note [DeepSpeed checkpoints] in
deepspeed_import.py): the DeepSpeed run resumes in zerospeed, at any ZeRO stage and data-parallel size.

Every rank reads the DeepSpeed files (memory-mapped) for the parameters its partitions hold, fills its
masters and optimizer states from their full tensors (as for a resharded zerospeed checkpoint), loads
the buffers and frozen weights into the module, and restores the optimizer's hyperparameters, the LR
scheduler, the counters and the loss scale. A tensor-parallel DeepSpeed tag (deepspeed_tp.py) gives the
same full tensors; a tensor-parallel engine cuts its own tp pieces out of them, at any tp degree.
DeepSpeed saves no RNG state: each rank keeps its own.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.deepspeed_autoep import is_deepspeed_autoep_zero3_tag, read_deepspeed_autoep_zero3_checkpoint
from zerospeed.checkpoint.deepspeed_autoep_zero0 import (
    is_deepspeed_autoep_zero0_tag,
    read_deepspeed_autoep_zero0_checkpoint,
)
from zerospeed.checkpoint.deepspeed_autoep_zero12 import (
    is_deepspeed_autoep_zero12_tag,
    read_deepspeed_autoep_zero12_checkpoint,
)
from zerospeed.checkpoint.deepspeed_experts import is_deepspeed_moe_tag, read_deepspeed_moe_checkpoint
from zerospeed.checkpoint.deepspeed_import import MODEL, read_deepspeed_checkpoint
from zerospeed.checkpoint.deepspeed_mpu_tp import cut_hand_split
from zerospeed.checkpoint.deepspeed_pipeline import refuse_pipeline_universal
from zerospeed.checkpoint.deepspeed_tp import is_deepspeed_tp_tag, read_deepspeed_tp_checkpoint
from zerospeed.checkpoint.errors import CheckpointError, raise_if_any_rank_failed
from zerospeed.checkpoint.placement import check_supported, checkpoint_names, placement, sharded_param_names
from zerospeed.checkpoint.state import TrainingState, restore_training_state
from zerospeed.checkpoint.tensor_parallel import reslice
from zerospeed.checkpoint.universal import FP32, fill_from_universal
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)


def load_deepspeed_checkpoint(
    state: TrainingState, tag_dir: Path, *, strict: bool, with_optimizer: bool, with_scheduler: bool, module_only: bool
):
    """Collective. Returns (the model-states file, client_state) as `load_checkpoint` does."""
    moe = is_deepspeed_moe_tag(tag_dir)  # Note [DeepSpeed MoE checkpoints] (deepspeed_experts.py)
    autoep = is_deepspeed_autoep_zero3_tag(tag_dir)  # Note [DeepSpeed AutoEP ZeRO-3 checkpoints] (deepspeed_autoep.py)
    autoep12 = is_deepspeed_autoep_zero12_tag(tag_dir)  # Note [DeepSpeed AutoEP ZeRO-1/2 checkpoints]
    autoep0 = is_deepspeed_autoep_zero0_tag(tag_dir)  # Note [DeepSpeed AutoEP ZeRO-0 checkpoints]
    check_supported(state, experts_ok=moe or autoep or autoep12 or autoep0, hand_split_ok=True)  # (cut_hand_split)
    place = placement(state)
    names = checkpoint_names(state, place)
    entries = names.global_entries(state.zero.shard_entries(names.params))  # (AutoEP: stacked experts)
    wanted = {p.name for e in entries for p in e.pieces}
    ckpt, error = None, None
    try:
        refuse_pipeline_universal(tag_dir)  # Note [DeepSpeed pipeline universal folders] (deepspeed_pipeline.py)
        if is_deepspeed_tp_tag(tag_dir):  # Note [DeepSpeed tensor-parallel checkpoints] (deepspeed_tp.py)
            reader = read_deepspeed_tp_checkpoint
        elif autoep0:
            reader = read_deepspeed_autoep_zero0_checkpoint
        elif autoep12:
            reader = read_deepspeed_autoep_zero12_checkpoint
        elif autoep:
            reader = read_deepspeed_autoep_zero3_checkpoint
        else:
            reader = read_deepspeed_moe_checkpoint if moe else read_deepspeed_checkpoint
        ckpt = reader(tag_dir, names=wanted, group_names=state.param_group_names)
        cut_hand_split(ckpt, names.specs, place, tag_dir)  # Note [DeepSpeed mpu tensor-parallel checkpoints]
        _check_matches(state, ckpt, names.specs, wanted, with_optimizer)
        _cut_to_tensor_parallel(ckpt, names.specs, place)
        with state.zero.resident(state.optimizer):
            _load_module(state, ckpt, strict)
            fill_from_universal(entries, ckpt.universal, state.optimizer, with_optimizer)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it before the collectives below
        error = (
            f"rank {comm.get_rank()}: loading the DeepSpeed checkpoint {tag_dir} failed: {type(exc).__name__}: {exc}"
        )
    raise_if_any_rank_failed(error)
    state.zero.sync_params_from_masters()
    if not module_only:  # DeepSpeed saves no micro-step count nor RNG state: both start afresh
        restore_training_state(
            state,
            {"optimizer_param_groups": ckpt.param_groups, **ckpt.meta},
            with_optimizer=with_optimizer,
            with_scheduler=with_scheduler,
        )
    comm.barrier()
    logger.info(
        "loaded DeepSpeed %s checkpoint %s (ZeRO-%d, %d ranks) into ZeRO-%d on %d ranks",
        ckpt.meta.get("ds_version"),
        tag_dir,
        ckpt.stage,
        ckpt.dp,
        state.zero.stage,
        state.mesh.size("dp_sp"),
    )
    files = sorted(tag_dir.glob("*model_states.pt"))
    return str(tag_dir / MODEL if (tag_dir / MODEL).exists() else files[0]), ckpt.client_state


def _check_matches(state: TrainingState, ckpt, specs: dict, wanted: set[str], with_optimizer: bool) -> None:
    missing = sorted(wanted - set(ckpt.universal.tensors))
    if missing:
        raise CheckpointError(
            f"{ckpt.tag_dir}: the DeepSpeed checkpoint has no weights for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} trainable parameters of "
            "this model); is it a checkpoint of this model?"
        )
    for name in wanted:
        have, want = ckpt.universal.tensors[name][FP32].numel(), math.prod(specs[name]["shape"])
        if have != want:
            raise CheckpointError(
                f"{ckpt.tag_dir}: {name} has {have} elements in the DeepSpeed checkpoint, "
                f"{want} in this model (shape {tuple(specs[name]['shape'])})"
            )
    opt = state.optimizer
    if with_optimizer and opt is not None and len(ckpt.param_groups) != len(opt.param_groups):
        raise CheckpointError(
            f"{ckpt.tag_dir}: the DeepSpeed checkpoint has {len(ckpt.param_groups)} optimizer param "
            f"groups, this engine {len(opt.param_groups)}; pass "
            "load_optimizer_states=False to load the weights only"
        )


def _cut_to_tensor_parallel(ckpt, specs: dict, place) -> None:
    """This rank's tp piece of each full tensor (Note [canonical tensors]); nothing to do without tp."""
    if place.tp == 1:
        return
    for name, full in ckpt.universal.tensors.items():
        layout, shape = place.layouts.get(name), specs[name]["shape"]
        full.update({k: reslice(t.view(shape), layout, place.tp_rank).reshape(-1) for k, t in full.items()})


@torch.no_grad()
def _load_module(state: TrainingState, ckpt, strict: bool) -> None:
    """Buffers and frozen weights from the checkpoint's module state; trainable weights come from the masters."""
    module = state.module
    sharded = sharded_param_names(module)
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    expected = set(module.state_dict().keys())
    saved = set(ckpt.module) | set(ckpt.universal.tensors)
    if strict:
        problems = [
            f"missing {sorted(expected - saved - trainable)[:5]}" if expected - saved - trainable else "",
            f"unexpected {sorted(set(ckpt.module) - expected)[:5]}" if set(ckpt.module) - expected else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(
                f"{ckpt.tag_dir}: the DeepSpeed checkpoint does not fit this model: "
                f"{'; '.join(problems)} (pass load_module_strict=False to skip them)"
            )
    values = {k: v for k, v in ckpt.module.items() if k in expected and k not in trainable and k not in sharded}
    module.load_state_dict(values, strict=False)
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = {id(params[n]): ckpt.module[n] for n in sharded if n in ckpt.module and n not in trainable}
    if frozen:
        state.zero.load_frozen(frozen)
