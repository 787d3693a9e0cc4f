"""`engine.load_checkpoint` of a checkpoint DeepSpeed saved (Note [DeepSpeed checkpoints] in
deepspeed_import.py): the DeepSpeed run resumes in zerospeed, at any ZeRO stage and data-parallel size.

Every rank reads the DeepSpeed files (memory-mapped) for the parameters its partitions hold, fills its
masters and optimizer states from their full tensors (as for a resharded zerospeed checkpoint), loads
the buffers and frozen weights into the module, and restores the optimizer's hyperparameters, the LR
scheduler, the counters and the loss scale. DeepSpeed saves no RNG state: each rank keeps its own.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.deepspeed_import import MODEL, read_deepspeed_checkpoint
from zerospeed.checkpoint.errors import CheckpointError, raise_if_any_rank_failed
from zerospeed.checkpoint.load import fill_from_universal
from zerospeed.checkpoint.save import _check_supported, engine_names, placement, sharded_param_names
from zerospeed.checkpoint.universal import FP32
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)

_GROUP_IDENTITY = ("params", "name", "moe")  # a group's membership is this engine's, not the checkpoint's


def load_deepspeed_checkpoint(engine, tag_dir: Path, *, strict: bool, with_optimizer: bool, with_scheduler: bool,
                              module_only: bool):
    """Collective. Returns (the model-states file, client_state) as `load_checkpoint` does."""
    _check_supported(engine, experts_ok=False)
    place = placement(engine)
    if place.tp > 1:
        raise CheckpointError(f"loading the DeepSpeed checkpoint {tag_dir} at tensor-parallel size {place.tp}: "
                              "DeepSpeed checkpoints load without tensor parallelism only")
    names = engine_names(engine, place)
    entries = engine.zero.shard_entries(names.params)
    wanted = {p.name for e in entries for p in e.pieces}
    ckpt, error = None, None
    try:
        ckpt = read_deepspeed_checkpoint(tag_dir, names=wanted, group_names=engine.param_group_names)
        _check_matches(engine, ckpt, names.specs, wanted, with_optimizer)
        with engine.zero.resident(engine.optimizer):
            _load_module(engine, ckpt, strict)
            fill_from_universal(entries, ckpt.universal, engine.optimizer, with_optimizer)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 — every rank must learn of it before the collectives below
        error = f"rank {comm.get_rank()}: loading the DeepSpeed checkpoint {tag_dir} failed: {type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(error)
    engine.zero.sync_params_from_masters()
    if not module_only:
        _restore_training_state(engine, ckpt, with_optimizer, with_scheduler)
    comm.barrier()
    logger.info("loaded DeepSpeed %s checkpoint %s (ZeRO-%d, %d ranks) into ZeRO-%d on %d ranks",
                ckpt.meta.get("ds_version"), tag_dir, ckpt.stage, ckpt.dp, engine.zero_optimization_stage(),
                engine.mesh.size("dp_sp"))
    files = sorted(tag_dir.glob("*model_states.pt"))
    return str(tag_dir / MODEL if (tag_dir / MODEL).exists() else files[0]), ckpt.client_state


def _check_matches(engine, ckpt, specs: dict, wanted: set[str], with_optimizer: bool) -> None:
    missing = sorted(wanted - set(ckpt.universal.tensors))
    if missing:
        raise CheckpointError(f"{ckpt.tag_dir}: the DeepSpeed checkpoint has no weights for {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} ({len(missing)} trainable parameters of "
                              "this model); is it a checkpoint of this model?")
    for name in wanted:
        have, want = ckpt.universal.tensors[name][FP32].numel(), math.prod(specs[name]["shape"])
        if have != want:
            raise CheckpointError(f"{ckpt.tag_dir}: {name} has {have} elements in the DeepSpeed checkpoint, "
                                  f"{want} in this model (shape {tuple(specs[name]['shape'])})")
    if with_optimizer and engine.optimizer is not None and len(ckpt.param_groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"{ckpt.tag_dir}: the DeepSpeed checkpoint has {len(ckpt.param_groups)} optimizer param "
                              f"groups, this engine {len(engine.optimizer.param_groups)}; pass "
                              "load_optimizer_states=False to load the weights only")


@torch.no_grad()
def _load_module(engine, ckpt, strict: bool) -> None:
    """Buffers and frozen weights from the checkpoint's module state; trainable weights come from the masters."""
    module = engine.module
    sharded = sharded_param_names(module)
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    expected = set(module.state_dict().keys())
    saved = set(ckpt.module) | set(ckpt.universal.tensors)
    if strict:
        problems = [f"missing {sorted(expected - saved - trainable)[:5]}" if expected - saved - trainable else "",
                    f"unexpected {sorted(set(ckpt.module) - expected)[:5]}" if set(ckpt.module) - expected else ""]
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(f"{ckpt.tag_dir}: the DeepSpeed checkpoint does not fit this model: "
                                  f"{'; '.join(problems)} (pass load_module_strict=False to skip them)")
    values = {k: v for k, v in ckpt.module.items() if k in expected and k not in trainable and k not in sharded}
    module.load_state_dict(values, strict=False)
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = {id(params[n]): ckpt.module[n] for n in sharded if n in ckpt.module and n not in trainable}
    if frozen:
        engine.zero.load_frozen(frozen)


def _restore_training_state(engine, ckpt, with_optimizer: bool, with_scheduler: bool) -> None:
    opt = engine.optimizer
    if opt is not None and (with_optimizer or with_scheduler):
        for group, saved in zip(opt.param_groups, ckpt.param_groups):
            for k, v in saved.items():
                if k in _GROUP_IDENTITY or k not in group or (not with_optimizer and k != "lr"):
                    continue
                group[k] = v
    meta = ckpt.meta
    if with_scheduler and engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.loss_scaler is not None and meta.get("loss_scaler"):
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps = int(meta.get("global_steps") or 0)
    engine.global_samples = int(meta.get("global_samples") or 0)
    engine.skipped_steps = int(meta.get("skipped_steps") or 0)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
