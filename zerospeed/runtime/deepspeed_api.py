"""DeepSpeed's engine surface as a facade over `EngineCore` (runtime/core.py): the small methods
`DeepSpeedEngine` offers to read its configuration (`engine.zero_offload_optimizer()`,
`engine.optimizer_name()`, `engine.dynamic_loss_scale()`, ...), to change the batch size and to make a
data loader (`deepspeed_io`), which training scripts, Megatron-DeepSpeed and integrations call; and the
rest of its methods and attribute names (checkpoints and 16-bit saves, `offload_states`,
`memory_breakdown`, `dump_state`, the schedulers of the step hooks, ...), each delegating to the core's
parts or to a module of its own. The core never calls the facade.

Each answers from the parsed config (`engine.config`, DeepSpeed's keys; a section is returned as the
config section itself, whose fields carry DeepSpeed's names) with DeepSpeed's meaning: e.g.
`zero_optimization()` is "stage > 0", `postscale_gradients()` is "not prescale_gradients",
`dynamic_loss_scale()` is "fp16 loss_scale == 0". Where DeepSpeed's own answer is a known slip, the
documented meaning wins: `get_batch_info()` returns the three sizes, not the three bound methods.
Accessors of features zerospeed does not build answer what the config says (so a script that only
reads them runs), and the features themselves stay refused where the config asks for them.
"""

from __future__ import annotations

import gc
import os

import torch

from zerospeed import checkpoint
from zerospeed.compression.scheduler import compression_scheduler
from zerospeed.data.curriculum import CurriculumScheduler
from zerospeed.data.loader import ShardedDataLoader
from zerospeed.data.progressive_layer_drop import ProgressiveLayerDrop
from zerospeed.data.random_ltd.helper import remove_random_ltd_state_dict
from zerospeed.data.random_ltd.scheduler import RandomLTDScheduler
from zerospeed.data.sampler import build_curriculum_loader
from zerospeed.offload.states import StateOffloader
from zerospeed.runtime import reports, state_offload
from zerospeed.runtime.checkpoint_saves import engine_saves, flush_saves
from zerospeed.runtime.hooks import (
    CompressionHook,
    CurriculumHook,
    LayerDropHook,
    RandomLTDHook,
    bind_random_ltd,
    scheduler_of,
)
from zerospeed.runtime.plans import random_ltd_config
from zerospeed.runtime.process_settings import PYTHON_GC, release_python_gc


class DeepSpeedAPI:
    """Mixed into the engines over `EngineCore`: DeepSpeed's methods and attribute names, answered from
    the core's parts and, for the configuration accessors, from `engine.config`."""

    # -- the parts under DeepSpeed's names -------------------------------------------------------------
    @property
    def curriculum_scheduler_legacy(self) -> CurriculumScheduler | None:
        return scheduler_of(self.step_hooks, CurriculumHook)

    @property
    def progressive_layer_drop(self) -> ProgressiveLayerDrop | None:
        return scheduler_of(self.step_hooks, LayerDropHook)

    @property
    def random_ltd_scheduler(self) -> RandomLTDScheduler | None:
        return scheduler_of(self.step_hooks, RandomLTDHook)

    @property
    def compression_scheduler(self) -> compression_scheduler | None:
        """The compressed layers' step counter (`init_compression` ran on the model), else None."""
        return scheduler_of(self.step_hooks, CompressionHook)

    @property
    def trial_probe(self):
        """The autotuning trial's probe when `zerospeed --autotuning` started this process, else None
        (the observer runs it)."""
        return getattr(self.observer, "trial_probe", None)

    def curriculum_enabled_legacy(self) -> bool:
        return self.curriculum_scheduler_legacy is not None

    def curriculum_params_legacy(self) -> dict:
        return self.config.curriculum_learning.model_dump()

    def random_ltd_initialize(self) -> None:
        """Bind the model's random-LTD wrappers to `random_ltd_scheduler` (convert_to_random_ltd calls it)."""
        bind_random_ltd(self)

    def get_pld_theta(self) -> float | None:
        pld = self.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    # -- the step's outcome ------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before the first)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights: False after a micro-step inside an accumulation
        window and after a boundary step skipped for an fp16 overflow (DeepSpeed's semantics)."""
        return self._step_applied

    # -- where the states are, what they take ------------------------------------------------------------
    def placement(self) -> dict[str, str]:
        """Where each kind of model state lives on this rank: a device ("cpu", "cuda:0") or
        "nvme:<dir>" (ZeRO-Offload / ZeRO-Infinity), read off the tensors and swap files."""
        return self.zero.placement()

    def swap_files(self) -> list:
        """(kind, path, bytes) of this rank's NVMe swap files."""
        return self.zero.swap_files()

    def memory_breakdown(self) -> dict[str, dict[str, float]]:
        """Per-rank model-state bytes held by the engine, next to the ZeRO formula's prediction."""
        return reports.memory_breakdown(self)

    def dump_state(self) -> None:
        """`dump_state`: log what this engine was built from and into (rank 0; `initialize` calls it when the
        config's `dump_state` is true, as DeepSpeed prints its engine's attributes)."""
        reports.dump_state(self)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free what stage 3 keeps of gathered weights between uses. zerospeed releases every
        non-persistent unit when its forward (or a micro-step) ends, so there is no such cache; this
        releases any unit still gathered and returns the allocator's cached blocks to the device."""
        self.zero.release_gathered()
        gc.collect()
        self.accelerator.empty_cache()

    # -- offload_states / reload_states (Note [offloaded states] in offload/states.py) -------------------
    @property
    def state_offloader(self) -> StateOffloader:
        if self._state_offloader is None:
            self._state_offloader = StateOffloader()
        return self._state_offloader

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's: move this rank's training states (`include`: OffloadStateTypeEnum kinds; all by
        default) to host memory until `reload_states()`, freeing their device memory. States already on
        the host (an offloaded optimizer's masters and moments) are left out, as in DeepSpeed."""
        state_offload.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: bring back what `offload_states` moved, onto the devices it came from."""
        self.state_offloader.reload(non_blocking)

    # -- checkpoints and 16-bit saves (zerospeed.checkpoint does the work) -----------------------------
    def save_checkpoint(
        self, save_dir, tag=None, client_state=None, save_latest: bool = True, exclude_frozen_parameters: bool = False
    ):
        """Collective: save the training state under save_dir/tag. With an asynchronous writer (`checkpoint.writer`
        decoupled, `datastates_ckpt`, `casync_ckpt`) it returns once the state is copied to host memory and the
        checkpoint commits (`latest` moves) at a later optimizer step, save, load, `wait_for_checkpoint()` or
        `destroy()` (docs/checkpoints.md)."""
        self._check_states_resident("engine.save_checkpoint")
        return checkpoint.save_checkpoint(
            self.checkpoint_state(),
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            saves=engine_saves(self),
        )

    def wait_for_checkpoint(self) -> None:
        """Collective: block until the asynchronous save in flight (if any) is on disk on every rank and
        committed (`latest` names it); a failed write raises here. DeepSpeed's decoupled writer commits the
        same way at its next step (its `_commit_decoupled_checkpoint`), without a public name for it."""
        flush_saves(self)

    def destroy(self) -> None:
        """End of training: finish the checkpoint in flight, then what the core releases (EngineCore.destroy);
        the Python collector comes back on if `disable_python_gc` turned it off (runtime/process_settings.py)."""
        try:
            flush_saves(self)
            super().destroy()
        finally:
            release_python_gc(self)

    def collect_python_gc(self) -> int:
        """One explicit cyclic collection at a point the caller picks (with `disable_python_gc`); returns
        the number of unreachable objects found. The collector's on/off state is left as it is."""
        return PYTHON_GC.collect()

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        """Restore a checkpoint (any world size, ZeRO stage 0-3); returns (load_path, client_state)."""
        self._check_states_resident("engine.load_checkpoint")
        flush_saves(self)  # a save in flight commits first: its tag may be the one asked for
        return checkpoint.load_checkpoint(
            self.checkpoint_state(),
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            async_load=engine_saves(self).plan.async_load,
            universal=self.config.checkpoint.load_universal,
        )

    def module_state_dict(
        self, destination=None, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict:
        """DeepSpeed's: the module's own `state_dict` (at stage 3 its weights are this rank's empty
        placeholders, as in DeepSpeed; `_zero3_consolidated_16bit_state_dict` gathers them), without
        frozen parameters when `exclude_frozen_parameters`, and under the plain model's names when
        random-LTD wraps layers."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        if self.random_ltd_scheduler is not None:  # the plain model's names, as DeepSpeed gives them
            sd = remove_random_ltd_state_dict(sd)
        return sd

    def save_16bit_model(
        self, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ):
        return checkpoint.save_16bit_model(self.checkpoint_state(), save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin"):
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's switch for consolidated saves at stage 3 (accelerate and transformers read it)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """Collective: the full module state dict in its training dtype on rank 0 ({} elsewhere), gathered
        unit by unit — the name transformers and accelerate call under ZeRO-3."""
        return checkpoint.without_frozen(self.module, self.zero.full_state_dict(), exclude_frozen_parameters)

    # -- batch sizes -------------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch size reached by changing the accumulation steps (the micro-batch
        size stays); it must divide by micro batch x data-parallel size."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): the global batch must be a positive multiple "
                f"of train_micro_batch_size_per_gpu x data-parallel size = {per_step}"
            )
        self.config.train_batch_size = train_batch_size
        self.config.gradient_accumulation_steps = train_batch_size // per_step

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size with the same accumulation steps (the global batch follows)."""
        if micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): the micro-batch size must be >= 1")
        self.config.train_micro_batch_size_per_gpu = micro_batch_size
        self.config.train_batch_size = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def deepspeed_io(
        self,
        dataset,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler=None,
        collate_fn=None,
        num_local_io_workers: int | None = None,
    ):
        """DeepSpeed's: a loader of this data-parallel rank's batches of `dataset` (micro batches by
        default). The train route shuffles as `initialize(training_data=...)` does; "eval" / "predict"
        keep the order; a given `data_sampler` is used as it is."""
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError("deepspeed_io: the data must be a torch Dataset (map-style or iterable)")
        batch_size = batch_size or self.train_micro_batch_size_per_gpu()
        workers = num_local_io_workers or 0
        if (
            route == "train" and self.curriculum_learning_enabled()
        ):  # (DeepSpeed: on every route; Note in data/sampler.py)
            return build_curriculum_loader(
                dataset,
                self.data_efficiency_config(),
                batch_size,
                dp_rank=self.mesh.rank_in("dp"),
                dp_world=self.dp_world_size,
                dp_group=self.dp_group,
                gradient_accumulation_steps=self.gradient_accumulation_steps(),
                global_rank=self.global_rank,
                collate_fn=collate_fn,
                drop_last=self.config.dataloader_drop_last,
            )
        if data_sampler is not None or self.is_iterable_style_dataset(dataset):
            return torch.utils.data.DataLoader(
                dataset,
                batch_size=batch_size,
                sampler=data_sampler,
                collate_fn=collate_fn,
                num_workers=workers,
                pin_memory=pin_memory,
                drop_last=self.config.dataloader_drop_last,
            )
        return ShardedDataLoader(
            dataset,
            batch_size,
            rank=self.mesh.rank_in("dp"),
            world_size=self.dp_world_size,
            collate_fn=collate_fn,
            shuffle=route == "train",
            seed=0,
            drop_last=self.config.dataloader_drop_last,
            num_workers=workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
        )

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # -- parallel ranks ------------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank_in("dp")

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.rank_in("tp")

    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank_in("tp")

    def get_sequence_parallel_group(self):
        return self.mesh.group("sp")

    # -- optimizer and scheduler -------------------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """The config's optimizer type (lower-cased, as DeepSpeed does, when it names one of DeepSpeed's own
        optimizers: "AdamW" -> "adamw"); without one, the class name of the client optimizer."""
        if self.config.optimizer is None:
            return type(self.optimizer).__name__ if self.optimizer is not None else None
        name = self.config.optimizer.type
        return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def optimizer_legacy_fusion(self) -> bool:
        return bool(self.config.optimizer.legacy_fusion) if self.config.optimizer is not None else False

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def _optimizer_param(self, key: str) -> list:
        if self.optimizer is None:
            raise ValueError(f"the engine has no optimizer: no {key!r} to read")
        return [group[key] for group in self.optimizer.param_groups]

    def get_type(self) -> list:
        return self._optimizer_param("type")

    def get_mom(self) -> list:
        """Each param group's momentum (SGD, RMSprop) or betas (the others), as DeepSpeed reads them."""
        return self._optimizer_param("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self.config.zero_force_ds_cpu_optimizer

    # -- precision -----------------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.float16

    def bf16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.bfloat16

    def bfloat16_enabled(self) -> bool:  # DeepSpeed's name
        return self.bf16_enabled()

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2**self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        """DeepSpeed's dynamic loss scaler arguments, under its key names."""
        fp16 = self.config.fp16
        return {
            "init_scale": 2**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self.config.fp16.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def amp_enabled(self) -> bool:
        return self.config.amp.enabled

    def amp_params(self) -> dict:
        return self.config.amp.model_dump(exclude={"enabled"})

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype:
        return _DTYPES[self.config.torch_autocast.dtype]

    def torch_autocast_lower_precision_safe_modules(self):
        return self.config.torch_autocast.lower_precision_safe_modules

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the configured one, else fp16 / bf16 when training in it."""
        configured = self.config.communication_data_type
        if configured is not None:
            return _DTYPES[configured] if isinstance(configured, str) else configured
        if self.fp16_enabled():
            return torch.float16
        return torch.bfloat16 if self.bf16_enabled() else torch.float32

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's training dtype, the gradient accumulation dtype), as DeepSpeed reports them."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bf16_enabled() else torch.float32
        accum = self.config.data_types.grad_accum_dtype
        return model, (model if accum is None else _DTYPES[accum] if isinstance(accum, str) else accum)

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    # -- ZeRO ----------------------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_offload_optimizer(self):
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "nvme"

    def zero_partial_offload(self) -> float:
        return getattr(self.config.zero_optimization.offload_optimizer, "ratio", 1.0)

    def super_offload(self) -> bool:
        return getattr(self.config.zero_optimization.offload_optimizer, "super_offload", False)

    def cpuadam_cores_perc(self) -> float:
        return getattr(self.config.zero_optimization.offload_optimizer, "cpuadam_cores_perc", 0.9)

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.stage3_max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.stage3_prefetch_bucket_size

    def zero_module_granularity_threshold(self) -> int:
        return self.config.zero_optimization.stage3_module_granularity_threshold

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero_optimization.stage3_param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self.config.zero_optimization.stage3_model_persistence_threshold

    def zero_allgather_sequential(self) -> bool:
        return self.config.zero_optimization.stage3_allgather_sequential

    def is_sanity_checks_enabled(self) -> bool:
        return self.config.zero_optimization.enable_sanity_checks

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return self.config.zero_optimization.use_multi_rank_bucket_allreduce

    def zero_log_trace_cache_warnings(self) -> bool:
        return self.config.zero_optimization.log_trace_cache_warnings

    def mics_shard_size(self) -> int:
        return self.config.zero_optimization.mics_shard_size

    def zenflow_config(self):
        return self.config.zero_optimization.zenflow

    # -- rules of their own -----------------------------------------------------------------------------------
    def pld_params(self) -> dict:
        return self.config.progressive_layer_drop.model_dump(exclude={"enabled"})

    def data_efficiency_config(self) -> dict:
        return self.config.data_efficiency.model_dump()

    def data_sampling_config(self) -> dict:
        return self.config.data_efficiency.data_sampling.model_dump()

    def data_sampling_enabled(self) -> bool:
        return bool(self.config.data_efficiency.data_sampling.enabled)

    def curriculum_learning_config(self) -> dict:
        return self.config.data_efficiency.data_sampling.curriculum_learning.model_dump()

    def random_ltd_enabled(self) -> bool:
        return self.random_ltd_scheduler is not None

    def random_ltd_config(self) -> dict:
        return random_ltd_config(self.config)

    def curriculum_learning_enabled(self) -> bool:
        return bool(self.config.data_efficiency.data_sampling.curriculum_learning.enabled)

    def flops_profiler_enabled(self) -> bool:
        return self.config.flops_profiler.enabled or self.config.autotuning.enabled

    def flops_profiler_profile_step(self) -> int:
        at = self.config.autotuning
        return at.start_profile_step if at.enabled else self.config.flops_profiler.profile_step

    def flops_profiler_detailed(self) -> bool:
        return False if self.config.autotuning.enabled else self.config.flops_profiler.detailed

    def autotuning_metric_path(self) -> str:
        return self.config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self.config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        info = self.config.autotuning.model_info
        return bool(self.config.autotuning.enabled and info is not None and info.profile)

    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() == "FAIL"

    def checkpoint_serialization_enabled(self) -> bool:
        return self.config.checkpoint.checkpoint_serialization

    def checkpoint_writer_enabled(self) -> bool:
        return self.config.checkpoint.writer is not None

    def is_deepcompile_enabled(self) -> bool:
        return self.config.compile.deepcompile

    def is_deepcompile_active(self) -> bool:
        return False  # DeepCompile is not built (compile.deepcompile=true is refused)


def _zero_field(name: str, doc: str):
    def accessor(self):
        return getattr(self.config.zero_optimization, name)

    accessor.__name__ = accessor.__qualname__ = f"zero_{name}" if not name.startswith("zero") else name
    accessor.__doc__ = doc
    return accessor


# the accessors DeepSpeed names after a zero_optimization key of the same name
for _key in (
    "reduce_scatter",
    "overlap_comm",
    "sub_group_size",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "contiguous_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "legacy_stage1",
    "ignore_unused_parameters",
    "allgather_partitions",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "save_muon_momentum_buffer_in_memory",
):
    _accessor = _zero_field(_key, f"zero_optimization.{_key}")
    setattr(DeepSpeedAPI, _accessor.__name__, _accessor)


def _section_field(path: str, name: str):
    section, _, key = path.rpartition(".")

    def accessor(self):
        value = self.config
        for part in section.split(".") if section else ():
            value = getattr(value, part)
        return getattr(value, key)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = path
    return accessor


# DeepSpeed accessor name -> the config key it reads
_READS = {
    "wall_clock_breakdown": "wall_clock_breakdown",
    "log_level": "log_level",
    "graph_harvesting": "graph_harvesting",
    "sparse_gradients_enabled": "sparse_gradients",
    "managed_gradient_accumulation": "managed_gradient_accumulation",
    "elasticity_enabled": "elasticity.enabled",
    "pld_enabled": "progressive_layer_drop.enabled",
    "pld_theta": "progressive_layer_drop.theta",
    "pld_gamma": "progressive_layer_drop.gamma",
    "eigenvalue_enabled": "eigenvalue.enabled",
    "eigenvalue_verbose": "eigenvalue.verbose",
    "eigenvalue_max_iter": "eigenvalue.max_iter",
    "eigenvalue_tol": "eigenvalue.tol",
    "eigenvalue_stability": "eigenvalue.stability",
    "eigenvalue_gas_boundary_resolution": "eigenvalue.gas_boundary_resolution",
    "eigenvalue_layer_name": "eigenvalue.layer_name",
    "eigenvalue_layer_num": "eigenvalue.layer_num",
    "data_efficiency_enabled": "data_efficiency.enabled",
    "flops_profiler_recompute_fwd_factor": "flops_profiler.recompute_fwd_factor",
    "flops_profiler_module_depth": "flops_profiler.module_depth",
    "flops_profiler_top_modules": "flops_profiler.top_modules",
    "flops_profiler_output_file": "flops_profiler.output_file",
    "autotuning_enabled": "autotuning.enabled",
    "autotuning_start_profile_step": "autotuning.start_profile_step",
    "autotuning_end_profile_step": "autotuning.end_profile_step",
    "autotuning_metric": "autotuning.metric",
    "tensor_parallel_config": "tensor_parallel",
    "autotp_size": "tensor_parallel.autotp_size",
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "load_universal_checkpoint": "checkpoint.load_universal",
    "aio_config": "aio",
}
for _name, _path in _READS.items():
    setattr(DeepSpeedAPI, _name, _section_field(_path, _name))


_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DEEPSPEED_OPTIMIZERS = frozenset(
    {
        "adagrad",
        "adam",
        "adamw",
        "lamb",
        "onebitadam",
        "onebitlamb",
        "zerooneadam",
        "muadam",
        "muadamw",
        "musgd",
        "lion",
        "muon",
    }
)
