"""`zerospeed.initialize` and `add_config_arguments`: the DeepSpeed entry points."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from zerospeed import activation, comm
from zerospeed.accelerator import get_accelerator
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.comm.mpu import MeshMpu
from zerospeed.compression.weight_quant.layer import apply_weight_quantization_config
from zerospeed.config import ConfigError, auto_values_from_hidden_size, parse_config
from zerospeed.config.loader import load_raw
from zerospeed.data.loader import build_training_loader
from zerospeed.data.sampler import build_curriculum_loader
from zerospeed.moe.autoep import apply_autoep_config
from zerospeed.moe.layer import bind_expert_groups
from zerospeed.moe.utils import moe_param_groups
from zerospeed.optim import build_lr_scheduler
from zerospeed.optim.adam import DeepSpeedCPUAdam
from zerospeed.optim.factory import is_zero_tested_optimizer, optimizer_for_groups
from zerospeed.optim.lion import DeepSpeedCPULion
from zerospeed.optim.muon import muon_param_groups, uses_muon
from zerospeed.optim.param_groups import trainable_param_groups
from zerospeed.parallel.pipeline.module import PipelineModule
from zerospeed.parallel.tensor.config import apply_autotp_config, tensor_parallel_size
from zerospeed.runtime.engine import Engine
from zerospeed.runtime.hybrid_engine import DeepSpeedHybridEngine
from zerospeed.runtime.pipeline import PipelineEngine
from zerospeed.runtime.plans import build_plans
from zerospeed.runtime.process_settings import apply_log_level, hold_python_gc
from zerospeed.utils.errors import ConfigAssertionError, ZeroConfigError
from zerospeed.utils.logging import get_logger
from zerospeed.zero.tags import full_shape

logger = get_logger(__name__)  # Note [rank-0 logging]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed [CONFIG]` and `--deepspeed_config CONFIG` (the flags DeepSpeed users pass)."""
    group = parser.add_argument_group("zerospeed", "DeepSpeed-compatible configuration")
    group.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=False,
        help="enable zerospeed; optionally followed by the path of the JSON config",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="path of the DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def _take_deepscale_config(args) -> None:
    """DeepSpeed still reads the deprecated `args.deepscale_config` (with a warning) as the config path."""
    old = getattr(args, "deepscale_config", None)
    if old is None:
        return
    logger.warning("--deepscale_config is deprecated; use --deepspeed_config")
    if getattr(args, "deepspeed_config", None) is not None:
        raise ConfigError(
            f"initialize: both args.deepscale_config ({old!r}) and args.deepspeed_config "
            f"({args.deepspeed_config!r}) are set; keep --deepspeed_config only"
        )
    args.deepspeed_config, args.deepscale_config = old, None


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError("initialize: give `config` or `config_params`, not both")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        _take_deepscale_config(args)
        from_args = getattr(args, "deepspeed_config", None)
        flag = getattr(args, "deepspeed", None)
        if from_args is None and isinstance(flag, str):
            from_args = flag
    if from_args is not None and config is not None:
        raise ConfigError(
            f"initialize: the config was given twice — as args.deepspeed_config ({from_args!r}) and "
            "as initialize(config=...); keep one of them"
        )
    if from_args is None and config is None:
        raise ConfigError(
            "initialize: no config; pass config=<dict or path> or --deepspeed_config <path> "
            "(via zerospeed.add_config_arguments(parser))"
        )
    return config if config is not None else from_args


def _hidden_size(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def _param_groups(model, optimizer, model_parameters) -> list[dict]:
    """The trainable parameter groups to partition, normalised once (`optim.param_groups`): the client
    optimizer's groups, else the user's `model_parameters` (tensors or group dicts), else all of the
    model's parameters. Everything after receives these groups."""
    if isinstance(optimizer, torch.optim.Optimizer):
        source = optimizer.param_groups
    else:
        source = model_parameters if model_parameters is not None else model.parameters()
    return trainable_param_groups(source, allow_empty=True)[0]


def _muon_halves(model, groups: list[dict], cfg) -> list[dict]:
    """Muon's param groups (optim/muon.py): DeepSpeed's `initialize` decides per parameter of the model
    (matrices not named embed / lm_head use Muon; a user's own `use_muon` is overwritten) and its engine
    splits every group into a Muon and an Adam half."""
    _refuse_with_muon(cfg.zero_optimization)
    flags = {id(p): uses_muon(name, len(full_shape(p))) for name, p in model.named_parameters()}
    missing = [p for g in groups for p in g["params"] if id(p) not in flags]
    if missing:
        raise ConfigError(
            f"optimizer.type: Muon decides per parameter of the model, and {len(missing)} of model_parameters "
            "are not parameters of `model`; pass them as part of the model"
        )
    return muon_param_groups(groups, flags, dict(cfg.optimizer.params or {}))


def _refuse_with_muon(zero) -> None:
    """What Muon does not run with: DeepSpeed's two refusals at stage 3, and NVMe (not built here)."""
    if zero.stage == 3 and zero.reduce_scatter:
        raise ConfigError(
            "zero_optimization.reduce_scatter: Muon and reduce scatter cannot be used together at ZeRO stage 3 "
            '(DeepSpeed refuses it too); set "reduce_scatter": false'
        )
    if zero.stage == 3 and zero.zero_quantized_gradients:
        raise ConfigError(
            "zero_optimization.zero_quantized_gradients: Muon and ZeRO++ quantized gradients (its all-to-all "
            "process group) cannot be used together at ZeRO stage 3 (DeepSpeed refuses it too); set it to false"
        )
    offload = zero.offload_optimizer
    if offload is not None and offload.device == "nvme":
        raise ConfigError(
            "optimizer.type: Muon with zero_optimization.offload_optimizer.device 'nvme' is not implemented "
            "yet (its momentum must be resident to be gathered); use device 'cpu' or 'none'"
        )


def _retarget(strategy, optimizer: torch.optim.Optimizer) -> None:
    """Point the client optimizer's groups at the strategy's masters. A group with no trainable
    parameter (the Trainer's no-decay group over a LoRA model: every bias and norm is frozen) was
    not partitioned; it stays in the optimizer, empty, so group indices (and a scheduler's per-group
    lrs) keep their meaning — as in DeepSpeed."""
    groups = optimizer.param_groups
    trainable = [g for g in groups if any(p.requires_grad for p in g["params"])]
    if len(trainable) < len(groups):
        for g in groups:
            if g not in trainable:
                g["params"] = []
        view = argparse.Namespace(param_groups=trainable, state=optimizer.state)
        strategy.retarget(view)
    else:
        strategy.retarget(optimizer)


def _mesh(model, mpu, mesh, sp: int, tp: int = 1) -> ParallelMesh:
    """The parallel layout: the one given, a DeepSpeed/Megatron `mpu`, a PipelineModule's, or data
    parallelism over every rank — with a sequence axis of `sp` (the config's sequence_parallel_size)
    and a tensor axis of `tp` (tensor_parallel.autotp_size)."""
    if mesh is not None and mpu is not None:
        raise ConfigError("initialize: give `mesh` or `mpu`, not both (an mpu is another view of the same layout)")
    if mesh is None and mpu is not None:
        mesh = getattr(mpu, "mesh", None) if isinstance(mpu, MeshMpu) else ParallelMesh.from_mpu(mpu)
    if mesh is None and isinstance(model, PipelineModule):
        mesh = model.groups.mesh
    if mesh is None:
        return ParallelMesh.build(sp=sp, tp=tp) if sp * tp > 1 else ParallelMesh.data_parallel()
    if tp > 1 and mesh.size("tp") != tp:
        raise ConfigError(
            f"tensor_parallel.autotp_size is {tp} but the parallel layout given to initialize has a "
            f"tensor-parallel size of {mesh.size('tp')}; make them agree"
        )
    if sp > 1 and mesh.size("sp") != sp:
        raise ConfigError(
            f"sequence_parallel_size is {sp} but the parallel layout given to initialize has a "
            f"sequence-parallel size of {mesh.size('sp')}; make them agree (or drop the key and let "
            "the mesh/mpu decide)"
        )
    return mesh


def _sequence_parallel_size(loaded: dict) -> int:
    value = loaded.get("sequence_parallel_size", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"sequence_parallel_size must be a positive integer, got {value!r}")
    return value


def _refuse_forced_cpu_optimizer(cfg, optimizer) -> None:
    """Note [forced CPU optimizer]: DeepSpeed refuses a client optimizer (an instance or a callable) under
    optimizer offload unless it is one of its CPU optimizers, while `zero_force_ds_cpu_optimizer` is true
    (its default): a torch optimizer stepping offloaded states is slow there. zerospeed steps any torch
    Adam-family optimizer on offloaded shards with torch's fused CPU kernel, so the reason does not hold and
    the default accepts it; a config that sets the key to true explicitly asks for DeepSpeed's refusal,
    and gets it, as the exception DeepSpeed raises."""
    if optimizer is None or "zero_force_ds_cpu_optimizer" not in cfg.model_fields_set:
        return
    offload = cfg.zero_optimization.offload_optimizer
    if not cfg.zero_force_ds_cpu_optimizer or offload is None or offload.device not in ("cpu", "nvme"):
        return
    if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        return
    raise ZeroConfigError(
        f"zero_force_ds_cpu_optimizer is true and offload_optimizer.device is {offload.device!r}, so a client "
        f"optimizer ({type(optimizer).__name__}) is refused, as DeepSpeed does; give the optimizer in the "
        "config's `optimizer` section, use zerospeed.ops.adam.DeepSpeedCPUAdam, or set "
        "zero_force_ds_cpu_optimizer: false (zerospeed steps a torch optimizer's offloaded states with the "
        "fused CPU kernel, so false costs nothing here)"
    )


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config: Any = None,
    config_params: Any = None,
    mesh: ParallelMesh | None = None,
):
    """Wrap `model` for training; returns (engine, optimizer, training_dataloader, lr_scheduler).

    `mesh` (zerospeed's own; DeepSpeed has no such argument) is the parallel layout to train over;
    without it, `mpu` or a PipelineModule's grid gives it, else every rank is data parallel.
    """
    if model is None:  # DeepSpeed asserts: Note [errors catchable as DeepSpeed's] (utils/errors.py)
        raise ConfigAssertionError("initialize: `model` is required (the torch.nn.Module to train)")
    raw = _config_source(args, config, config_params)
    comm.init_distributed(dist_init_required=dist_init_required)
    loaded = load_raw(raw)  # the layout keys, read once before the mesh exists
    mesh = _mesh(model, mpu, mesh, _sequence_parallel_size(loaded), tensor_parallel_size(loaded))
    bind_expert_groups(model, mesh)  # Note [expert groups at initialize] (moe/layer.py)
    dp_group = mesh.group("dp")
    dp_world = mesh.size("dp")
    hidden = _hidden_size(model)
    known = auto_values_from_hidden_size(hidden) if hidden else {}
    cfg = parse_config(raw, world_size=dp_world, known=known)
    apply_log_level(cfg.log_level)
    model_parameters = apply_autotp_config(model, mesh, cfg, optimizer, model_parameters)  # parallel/tensor/config.py
    model_parameters = apply_autoep_config(model, mesh, cfg, optimizer, model_parameters)  # AutoEP (moe/autoep.py)
    quantize_shards = apply_weight_quantization_config(model, cfg)  # top-level weight_quantization
    if "activation_checkpointing" in cfg.model_fields_set:  # ZeRO-R: zerospeed.activation follows the config
        activation.configure(mpu_=mpu, deepspeed_config=cfg)

    is_client = isinstance(optimizer, torch.optim.Optimizer)
    param_groups = _param_groups(model, optimizer, model_parameters)
    if optimizer is None and cfg.optimizer is not None and str(cfg.optimizer.type).lower() == "muon":
        param_groups = _muon_halves(model, param_groups, cfg)
    param_groups = moe_param_groups(param_groups, client_optimizer=is_client)
    plans = build_plans(
        cfg,
        module=model,
        mesh=mesh,
        param_groups=param_groups,
        device=get_accelerator().torch_device(comm.get_local_rank()),
    )
    allow_untested = cfg.untested_optimizers_allowed

    _refuse_forced_cpu_optimizer(cfg, optimizer)

    def optimizer_factory(strategy):
        if is_client:
            if cfg.optimizer is not None:
                logger.warning(
                    "initialize: both a client optimizer and a config `optimizer` were given; "
                    "using the client optimizer"
                )
            if not allow_untested and not is_zero_tested_optimizer(optimizer):
                raise ConfigError(
                    f"{type(optimizer).__name__} is not tested with ZeRO stage {cfg.zero_stage}; "
                    "set zero_allow_untested_optimizer: true to use it anyway"
                )
            _retarget(strategy, optimizer)
            return optimizer
        if optimizer is None and cfg.optimizer is None:
            return None
        return optimizer_for_groups(
            cfg.optimizer.type if cfg.optimizer else None,
            cfg.optimizer.params if cfg.optimizer else None,
            strategy.optimizer_param_groups(),
            client_optimizer=optimizer,
            allow_untested=allow_untested,
        )

    def scheduler_factory(opt):
        if opt is None:
            return None
        return build_lr_scheduler(
            cfg.scheduler.type if cfg.scheduler else None,
            cfg.scheduler.params if cfg.scheduler else None,
            opt,
            client_scheduler=lr_scheduler,
        )

    loader = None
    if training_data is not None and cfg.data_efficiency.data_sampling.curriculum_learning.enabled:
        loader = build_curriculum_loader(  # data/sampler.py: Note [curriculum clusters]
            training_data,
            cfg.data_efficiency.model_dump(),
            cfg.train_micro_batch_size_per_gpu,
            dp_rank=comm.get_rank(dp_group),
            dp_world=dp_world,
            dp_group=dp_group,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            global_rank=comm.get_rank(),
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
        )
    elif training_data is not None:
        # DeepSpeed's order: shuffled for the engine, in order for a pipeline (DistributedSampler(shuffle=False))
        loader = build_training_loader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            rank=comm.get_rank(dp_group),
            world_size=dp_world,
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
            pipeline=isinstance(model, PipelineModule),
        )
    engine_cls = PipelineEngine if isinstance(model, PipelineModule) else Engine
    if cfg.hybrid_engine.enabled:
        if engine_cls is PipelineEngine:
            raise ConfigError(
                "hybrid_engine.enabled=true with a PipelineModule: the hybrid engine generates with "
                "the model's own generate; use a plain model"
            )
        engine_cls = DeepSpeedHybridEngine
    engine = engine_cls(
        model,
        cfg,
        plans,
        param_groups=param_groups,
        optimizer_factory=optimizer_factory,
        scheduler_factory=scheduler_factory,
        mesh=mesh,
        training_dataloader=loader,
    )
    if quantize_shards is not None:  # stage 3: the selected layers' stored shards (inference/zero.py)
        engine.zero.quantize_frozen(quantize_shards)
    hold_python_gc(engine, cfg.disable_python_gc)  # until engine.destroy() (runtime/process_settings.py)
    if cfg.dump_state:
        engine.dump_state()
    _compile_by_config(engine, cfg.compile)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _compile_by_config(engine, compile_cfg) -> None:
    """The older `compile` keys (`enabled`, `backend`, `kwargs`, ...): `engine.compile` at initialize."""
    if not compile_cfg.enabled or compile_cfg.disable:
        return
    if isinstance(engine, PipelineEngine):
        raise ConfigError(
            "compile.enabled=true with a PipelineModule: the pipeline engine does not compile its "
            "stages; remove compile.enabled (or call torch.compile on the layers yourself)"
        )
    kwargs = dict(compile_cfg.kwargs)
    kwargs.update(
        {
            k: v
            for k, v in (
                ("fullgraph", compile_cfg.fullgraph),
                ("dynamic", compile_cfg.dynamic),
                ("mode", compile_cfg.mode),
                ("options", compile_cfg.options),
            )
            if v not in (None, False)
        }
    )
    engine.compile(backend=compile_cfg.backend, compile_kwargs=kwargs)
