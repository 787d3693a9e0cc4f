"""Config in, plans out: the validated config translated once into the small frozen plans the parts take.

`initialize` calls `build_plans(cfg, ...)` once; the engine and everything below it receive plans, never
the config: the precision policy and the loss-scale plan (precision/), the ZeRO plan with its reduction
policy, budgets, ZeRO++ policy and offload plan (zero/, offload/), the schedules the step hooks run
(runtime/hooks.py), and the few step settings (clipping, skipping non-finite steps). Each plan is
defined in the package of its concept; this module only reads the config's keys and names them in its
errors (the concept packages' own rules, e.g. `PrecisionPolicy.resolve`, name the keys they are given).

(DeepSpeed's accessor facade, runtime/deepspeed_api.py, still answers from `engine.config`: it reports
the configuration, it does not act on it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed.offload.aio import AioPlan
from zerospeed.offload.plan import OffloadPlan
from zerospeed.offload.swap import check_nvme_path
from zerospeed.offload.zenflow import ZenFlowPlan
from zerospeed.precision.autocast import (
    AUTOCAST_LOSS_SCALE,
    check_autocast_settings,
    param_comm_dtypes,
)
from zerospeed.precision.loss_scaler import LossScalePlan
from zerospeed.precision.policy import PrecisionPolicy
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger
from zerospeed.zero.budgets import bounded_budgets
from zerospeed.zero.plan import LeafModulePlan, ReductionPolicy, ZeroPlan
from zerospeed.zero.stage3 import full_numel
from zerospeed.zero.stage3.zeropp import ZeroPPPolicy
from zerospeed.zero.strategy import resolve_mics_shard_size

logger = get_logger(__name__)  # Note [rank-0 logging]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SchedulesPlan:
    """The data-side techniques the step hooks run (runtime/hooks.py); None for each one off."""

    curriculum: dict | None = None
    """The legacy `curriculum_learning` block (CurriculumScheduler's settings) when enabled."""
    curriculum_seqlen: bool = False
    """`curriculum_type: "seqlen"`: the model receives the difficulty as `curriculum_seqlen`."""
    layer_drop: tuple[float, float] | None = None
    """`progressive_layer_drop`: (theta, gamma) when enabled."""
    random_ltd: dict | None = None
    """Random-LTD's block with the engine's batch sizes (`engine.random_ltd_config()`) when enabled."""

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.curriculum, self.layer_drop, self.random_ltd))


@dataclass(frozen=True)
class EnginePlans:
    """Everything the engine acts on, resolved from the config once."""

    precision: PrecisionPolicy
    loss_scale: LossScalePlan | None
    """None: no loss scaling (fp32 / bf16)."""
    zero: ZeroPlan
    schedules: SchedulesPlan
    gradient_clipping: float = 0.0
    skip_nonfinite: bool = False
    """An inf/nan gradient norm skips the step: always under loss scaling, for bf16 with
    `bf16.check_grad_overflow`."""
    cast_inputs: torch.dtype | None = None
    """`fp16.auto_cast`: the forward's floating positional inputs are cast to fp16."""
    buffer_dtype: torch.dtype | None = None
    """`data_types.buffer_dtype` under fp16/bf16: floating buffers take it instead of the model's dtype."""

    def describe(self) -> str:
        """One line: what this engine will do (logged once by `build_plans`)."""
        z, p = self.zero, self.precision
        parts = [
            f"zero stage {z.stage}",
            f"params {_name(p.param_dtype)}",
            f"grads {_name(p.grad_accum_dtype)}",
            f"masters {_name(p.master_dtype)}",
        ]
        if p.autocast_dtype is not None:
            parts.append(f"autocast {_name(p.autocast_dtype)}")
        if self.loss_scale is not None:
            ls = self.loss_scale
            parts.append(
                f"loss scale {ls.static_scale}"
                if ls.static_scale is not None
                else f"dynamic loss scale from {ls.init_scale:g}"
            )
        if z.reduction.comm_dtype is not None:
            parts.append(f"reduce in {_name(z.reduction.comm_dtype)}")
        if z.budgets is not None:
            b = z.budgets
            parts.append(
                f"buckets reduce {b.reduce_bucket:,}"
                + (f" / prefetch {b.prefetch_bucket:,} / reuse {b.reuse_distance:,}" if z.stage == 3 else "")
            )
        if z.offload is not None and (z.offload.optimizer, z.offload.param) != ("none", "none"):
            parts.append(f"offload optimizer {z.offload.optimizer} / params {z.offload.param}")
        zpp = [
            n
            for n, on in (
                ("qwZ", z.zeropp.quantized_weights),
                (f"hpZ {z.zeropp.hpz_size}", z.zeropp.hpz_size > 1),
                ("qgZ", z.zeropp.quantized_gradients),
                ("int8 frozen", z.zeropp.quantized_nontrainable),
            )
            if on
        ]
        if zpp:
            parts.append("ZeRO++ " + ", ".join(zpp))
        if z.mics_shard_size:
            parts.append(f"MiCS shards of {z.mics_shard_size}")
        hooks = [
            n
            for n, on in (
                ("curriculum", self.schedules.curriculum),
                ("layer drop", self.schedules.layer_drop),
                ("random-LTD", self.schedules.random_ltd),
            )
            if on is not None
        ]
        if hooks:
            parts.append("step hooks: " + ", ".join(hooks))
        parts.append(f"clip {self.gradient_clipping:g}")
        return "; ".join(parts)


def build_plans(cfg, *, module: torch.nn.Module, mesh, param_groups: list[dict], device: torch.device) -> EnginePlans:
    """Translate the validated config for training `module` (its trainable `param_groups`) over `mesh` on
    `device`; refuses combinations that cannot work, naming the keys. Logs the plans once (rank 0)."""
    precision = precision_policy(cfg)
    if precision.autocast_dtype is not None:
        check_autocast_settings(module, quantized_weights=cfg.zero_optimization.zero_quantized_weights)
    plans = EnginePlans(
        precision=precision,
        loss_scale=loss_scale_plan(cfg, precision),
        zero=zero_plan(cfg, module=module, mesh=mesh, param_groups=param_groups, device=device, precision=precision),
        schedules=schedules_plan(cfg),
        gradient_clipping=float(cfg.gradient_clipping),
        skip_nonfinite=precision.needs_loss_scaling or (cfg.bf16_enabled and cfg.bf16.check_grad_overflow),
        cast_inputs=torch.float16 if cfg.fp16.auto_cast and cfg.fp16_enabled else None,
        buffer_dtype=module_dtypes(cfg, precision),
    )
    logger.info("engine plans: %s", plans.describe())
    return plans


# -- precision -----------------------------------------------------------------------------------------
def module_dtypes(cfg, precision: PrecisionPolicy) -> torch.dtype | None:
    """`data_types.param_dtype` and `buffer_dtype` as DeepSpeed 0.19.8 reads them; returns the buffers' dtype.

    `param_dtype` may only restate the precision mode's model dtype (fp16 with `fp16.enabled`, bf16 with
    `bf16.enabled`, else fp32: DeepSpeed asserts the same), since masters, reduction and checkpoints
    follow the mode. `buffer_dtype` applies where DeepSpeed casts the module at all, under fp16 / bf16:
    floating buffers take it instead of the model's 16-bit dtype (e.g. fp32 rotary tables); in fp32 no
    cast happens, so it changes nothing and says so."""
    asked, buffers = cfg.data_types.param_dtype, cfg.data_types.buffer_dtype
    if asked is not None and _DTYPES[asked] != precision.param_dtype:
        mode = {torch.float16: "fp16.enabled", torch.bfloat16: "bf16.enabled"}.get(precision.param_dtype)
        raise ConfigError(
            f"data_types.param_dtype={asked!r} conflicts with the precision mode (model dtype "
            f"{_name(precision.param_dtype)}{f', from {mode}=true' if mode else ''}): set the matching "
            "fp16 / bf16 enabled flag, or remove data_types.param_dtype"
        )
    if buffers is None:
        return None
    if not precision.mixed:
        logger.warning(
            "data_types.buffer_dtype=%r has no effect without fp16 / bf16: the model is not cast, its "
            "buffers keep their dtype (as in DeepSpeed)",
            buffers,
        )
        return None
    return _DTYPES[buffers]


def precision_policy(cfg) -> PrecisionPolicy:
    """The precision keys (`fp16`, `bf16`, `torch_autocast`, `data_types`) as a `PrecisionPolicy`."""
    off = cfg.zero_optimization.offload_optimizer
    return PrecisionPolicy.resolve(
        fp16=cfg.fp16_enabled,
        bf16=cfg.bf16_enabled,
        autocast=cfg.torch_autocast.dtype if cfg.torch_autocast.enabled else None,
        grad_accum_dtype=cfg.data_types.grad_accum_dtype,
        bf16_master_weights_and_grads=cfg.bf16.bf16_master_weights_and_grads,
        bf16_optimizer_states=cfg.bf16.bf16_optimizer_states,
        zero_stage=cfg.zero_optimization.stage,
        optimizer_offload=off.device if off is not None else "none",
    )


def loss_scale_plan(cfg, precision: PrecisionPolicy) -> LossScalePlan | None:
    """fp16's loss scale (`fp16.loss_scale` 0: dynamic from 2**initial_scale_power), fp16 autocast's
    (`torch.amp.GradScaler`'s), or None without fp16."""
    if not precision.needs_loss_scaling:
        return None
    if precision.autocast_dtype is not None:
        return AUTOCAST_LOSS_SCALE
    fp16 = cfg.fp16
    if fp16.loss_scale != 0:
        return LossScalePlan(static_scale=fp16.loss_scale)
    return LossScalePlan(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


# -- ZeRO, offload ---------------------------------------------------------------------------------------
def zero_plan(
    cfg, *, module: torch.nn.Module, mesh, param_groups: list[dict], device: torch.device, precision: PrecisionPolicy
) -> ZeroPlan:
    """The `zero_optimization` section (with the top-level gradient keys and `aio`) as a `ZeroPlan`."""
    zero = cfg.zero_optimization
    mics = resolve_mics_shard_size(
        zero.mics_shard_size,
        stage=zero.stage,
        mesh=mesh,
        hpz_size=zero.zero_hpz_partition_size,
        quantized_gradients=zero.zero_quantized_gradients,
    )
    offload = offload_plan(cfg, device)  # also refuses offload keys the stage cannot honour
    zeropp = zeropp_policy(zero, offload.param)  # refuses ZeRO++ below stage 3
    reduction = ReductionPolicy(
        comm_dtype=_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        op="sum" if cfg.gradient_allreduce_op == "sum" else "avg",
        prescale=cfg.prescale_gradients,
        predivide_factor=cfg.gradient_predivide_factor,
        param_comm_dtypes=param_comm_dtypes(
            module, precision.autocast_dtype, cfg.torch_autocast.lower_precision_safe_modules
        )
        or None,
    )
    # Note [buckets bounded by the model] (zero/budgets.py): DeepSpeed's sizes as upper bounds
    budgets = bounded_budgets(
        sum(full_numel(p) for g in param_groups for p in g["params"]),
        reduce_bucket_size=int(zero.reduce_bucket_size),
        prefetch_bucket_size=int(zero.stage3_prefetch_bucket_size),
        max_reuse_distance=int(zero.stage3_max_reuse_distance),
        gathered_elements=sum(full_numel(p) for p in module.parameters()),
    )
    leaf = zero.leaf_module
    return ZeroPlan(
        stage=zero.stage,
        reduction=reduction,
        budgets=budgets,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        allgather_bucket_size=int(zero.allgather_bucket_size),
        sub_group_size=int(zero.sub_group_size),
        overlap_comm=bool(zero.overlap_comm),
        ignore_unused_parameters=bool(zero.ignore_unused_parameters),
        offload=offload,
        zenflow=zenflow_plan(cfg),
        zeropp=zeropp,
        mics_shard_size=mics,
        max_live_parameters=int(zero.stage3_max_live_parameters),
        param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
        model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
        module_granularity_threshold=int(zero.stage3_module_granularity_threshold),
        leaf_modules=None
        if leaf is None
        else LeafModulePlan(tuple(leaf.classes or ()), tuple(leaf.names or ()), tuple(leaf.name_suffixes or ())),
    )


def zenflow_plan(cfg) -> ZenFlowPlan | None:
    """`zero_optimization.zenflow` as a `ZenFlowPlan` (None without the block), with DeepSpeed's checks
    (runtime/zenflow/engine.py's `configure_zenflow`) and its resolution of "auto"."""
    zero = cfg.zero_optimization
    zf = zero.zenflow
    if zf is None:
        return None
    key = "zero_optimization.zenflow"
    if zero.stage not in (1, 2, 3):
        raise ConfigError(
            f"{key} needs ZeRO stage 1, 2 or 3 (this config has stage {zero.stage}): choose one, or remove the "
            "zenflow block"
        )
    if zero.offload_optimizer is None or zero.offload_optimizer.device != "cpu":
        raise ConfigError(f'{key} works on ZeRO-Offload: set zero_optimization.offload_optimizer.device to "cpu"')
    if zero.stage == 3 and zero.offload_param is not None and zero.offload_param.device == "nvme":
        raise ConfigError(
            f"{key} at stage 3 steps the selected columns in the parameter shards, which "
            'zero_optimization.offload_param.device "nvme" keeps on disk: use "cpu" or "none", or ZeRO stage 1/2'
        )
    if zf.select_strategy == "auto":
        if zf.select_interval != "auto":
            raise ConfigError(
                f'{key}.select_strategy "auto" selects once per epoch: leave select_interval "auto", '
                'or choose select_strategy "step" or "epoch"'
            )
        strategy, per = "epoch", 1
    else:
        if zf.select_interval == "auto":
            raise ConfigError(f"{key}.select_strategy {zf.select_strategy!r} needs a number as select_interval")
        strategy, per = zf.select_strategy, int(zf.select_interval)
    # an epoch of unknown length: select once (DeepSpeed's select_interval 0 without a training dataloader)
    select = per * (zf.steps_per_epoch or 0) if strategy == "epoch" else per
    update = 0 if zf.update_interval == "auto" else int(zf.update_interval)
    if update and select and select < update:
        raise ConfigError(f"{key}: select_interval ({select} steps) must be at least update_interval ({update})")
    return ZenFlowPlan(
        topk_ratio=float(zf.topk_ratio),
        select_interval=select,
        update_interval=update,
        auto_ratio=float(zf.auto_ratio),
        full_warm_up_rounds=int(zf.full_warm_up_rounds),
        overlap_step=bool(zf.overlap_step),
        offload=bool(zf.offload),
    )


def zeropp_policy(zero, offload_param: str = "none") -> ZeroPPPolicy:
    """ZeRO++'s switches of a `zero_optimization` section; `offload_param`: the parameters' offload device."""
    return ZeroPPPolicy.resolve(
        stage=zero.stage,
        quantized_weights=zero.zero_quantized_weights,
        hpz_partition_size=zero.zero_hpz_partition_size,
        quantized_gradients=zero.zero_quantized_gradients,
        quantized_nontrainable=zero.zero_quantized_nontrainable_weights,
        offload_param=offload_param,
    )


def offload_plan(cfg, device: torch.device) -> OffloadPlan:
    """`offload_optimizer` / `offload_param` (and `aio`) as an `OffloadPlan`; refuses what the ZeRO stage
    cannot honour, and checks that an NVMe path exists and is writable now."""
    zero = cfg.zero_optimization
    opt, par = zero.offload_optimizer, zero.offload_param
    opt_dev = opt.device if opt is not None else "none"
    par_dev = par.device if par is not None else "none"
    if opt_dev != "none" and zero.stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device="
            f"{opt_dev!r} needs ZeRO stage 1, 2 or 3 (the offloaded optimizer steps this "
            'rank\'s shard); set zero_optimization.stage to 1-3 or the device to "none"'
        )
    if par_dev != "none" and zero.stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_param.device={par_dev!r} needs ZeRO stage 3 "
            f"(this config has stage {zero.stage}); set zero_optimization.stage to 3 or "
            "remove offload_param"
        )
    ratio = opt.ratio if opt is not None else 1.0
    if ratio < 1.0 and (zero.stage != 3 or opt_dev != "cpu"):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio={ratio}: a partial offload works with "
            'ZeRO stage 3 and device "cpu" only; set ratio to 1.0'
        )
    delayed = _delayed_update(zero, opt_dev)
    pin = bool(
        (opt is not None and opt_dev != "none" and opt.pin_memory)
        or (par is not None and par_dev != "none" and par.pin_memory)
    )
    return OffloadPlan(
        device=device,
        optimizer=opt_dev,
        param=par_dev,
        pin=pin,
        ratio=ratio,
        optimizer_nvme=_nvme_dir(opt, "zero_optimization.offload_optimizer") if opt_dev == "nvme" else None,
        param_nvme=_nvme_dir(par, "zero_optimization.offload_param") if par_dev == "nvme" else None,
        optimizer_buffer_count=opt.buffer_count if opt is not None else 4,
        pipeline_read=bool(opt is not None and opt.pipeline_read),
        pipeline_write=bool(opt is not None and opt.pipeline_write),
        param_buffer_count=par.buffer_count if par is not None else 5,
        param_buffer_size=par.buffer_size if par is not None else 100_000_000,
        aio=aio_plan(cfg.aio),
        overlap_step=opt_dev == "cpu" and opt.overlap_step,
        # Note [overlapped step]: the step's coefficient is 1 whatever the norm, so steps may start early
        early_step=cfg.gradient_clipping == 0
        and not precision_policy(cfg).needs_loss_scaling
        and not (cfg.bf16_enabled and cfg.bf16.check_grad_overflow),
        delayed_update=delayed,
        delayed_warm_up=opt.delayed_param_update_warm_up if delayed else 0,
    )


def _delayed_update(zero, opt_dev: str) -> bool:
    """`offload_optimizer.delayed_param_update` (Note [delayed parameter update]), where it can be honoured."""
    opt, key = zero.offload_optimizer, "zero_optimization.offload_optimizer.delayed_param_update"
    if opt is None or not opt.delayed_param_update:
        return False
    if opt_dev != "cpu":
        raise ConfigError(f'{key} delays the host step of ZeRO-Offload: set offload_optimizer.device to "cpu"')
    if zero.stage not in (1, 2):
        raise ConfigError(
            f"{key} is built for ZeRO stages 1 and 2 (this config has stage {zero.stage}); use stage 1 or 2, "
            "or set it to false"
        )
    if zero.zenflow is not None:
        raise ConfigError(f"{key}: ZenFlow delays its own host step (zenflow.overlap_step); set it to false")
    return True


def aio_plan(aio) -> AioPlan:
    """The `aio` section as `AsyncIO`'s settings: `thread_count` and `intra_op_parallelism` are two names
    for the same knob, so the larger wins."""
    return AioPlan(
        block_size=aio.block_size,
        queue_depth=aio.queue_depth,
        thread_count=max(aio.thread_count, aio.intra_op_parallelism),
        single_submit=aio.single_submit,
        overlap_events=aio.overlap_events,
    )


def _nvme_dir(section, key: str) -> Path:
    """The nvme_path, checked to exist and be writable now (space is checked once sizes are known)."""
    return check_nvme_path(section.nvme_path, 0, key=f"{key}.nvme_path")


# -- schedules (the step hooks) -----------------------------------------------------------------------------
def schedules_plan(cfg) -> SchedulesPlan:
    """The legacy curriculum, progressive layer drop and random-LTD, each when enabled."""
    cl, pld = cfg.curriculum_learning, cfg.progressive_layer_drop
    return SchedulesPlan(
        curriculum=cl.model_dump() if cl.enabled else None,
        curriculum_seqlen=bool(cl.enabled and cl.curriculum_type == "seqlen"),
        layer_drop=(pld.theta, pld.gamma) if pld.enabled else None,
        random_ltd=_random_ltd(cfg),
    )


def random_ltd_config(cfg) -> dict:
    """DeepSpeed's `engine.random_ltd_config()`: the `random_ltd` block with the engine's batch sizes."""
    return {
        **cfg.data_efficiency.data_routing.random_ltd.model_dump(),
        "global_batch_size": cfg.train_batch_size,
        "micro_batch_size": cfg.train_micro_batch_size_per_gpu,
    }


def _random_ltd(cfg) -> dict | None:
    """Random-LTD's settings when `random_ltd.enabled` (DeepSpeed's only switch for it), else None."""
    efficiency = cfg.data_efficiency
    if not efficiency.data_routing.random_ltd.enabled:
        return None
    if not (efficiency.enabled and efficiency.data_routing.enabled):
        logger.warning(
            "random-LTD is on (data_efficiency.data_routing.random_ltd.enabled=true) although "
            "data_efficiency.enabled or data_efficiency.data_routing.enabled is false: DeepSpeed reads "
            "only random_ltd.enabled, and so does zerospeed"
        )
    return random_ltd_config(cfg)


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
