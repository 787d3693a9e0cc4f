"""`EngineCore`: the parts every engine is made of, and the optimizer step at a boundary.

The training `Engine` (forward / backward / step per micro-batch) and the `PipelineEngine`
(`train_batch` over a schedule) are both an `EngineCore` plus their own way of running micro-batches,
with DeepSpeed's accessor surface (`DeepSpeedAPI`, runtime/deepspeed_api.py) as a facade over it. The
core holds no feature logic and reads no config: it builds and sequences small objects from the plans
`initialize` resolved (`EnginePlans`, runtime/plans.py): the `PrecisionPolicy` (dtypes), the ZeRO
strategy (`zerospeed.zero.ZeroStrategy`, built over the parallel mesh), the optimizer and LR scheduler
(`zerospeed.optim`), the loss scaler (a pure state machine), the step hooks (runtime/hooks.py) and the
observer (timers, profiler, monitors).
"""

from __future__ import annotations

import math

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.checkpoint.state import TrainingState
from zerospeed.offload.delayed_update import delayed_stepper
from zerospeed.optim.sub_group_step import use_fused_cpu_step
from zerospeed.profiling.observer import EngineObserver
from zerospeed.runtime.hooks import RandomLTDHook, build_step_hooks, scheduler_of
from zerospeed.runtime.model_setup import (
    TrainedSizes,
    broadcast_model,
    cast_model,
    param_group_names,
    weight_tensor_parallel_norm,
)
from zerospeed.runtime.plans import EnginePlans
from zerospeed.runtime.state_offload import refuse_offloaded
from zerospeed.utils.logging import get_logger
from zerospeed.zero import build_strategy, reduction_groups
from zerospeed.zero.grad_math import clip_coefficient

logger = get_logger(__name__)  # Note [rank-0 logging]


class EngineCore(torch.nn.Module):
    """Precision, ZeRO strategy, optimizer, scheduler, loss scaler, step hooks and counters around `module`."""

    enable_backward_allreduce = True
    """DeepSpeed's switch: False leaves each rank's gradients unreduced at the accumulation boundary (the
    1-bit optimizers' compressed stages; Note [the engine's backward all-reduce] in optim/onebit)."""

    def __init__(
        self,
        module: torch.nn.Module,
        config,
        plans: EnginePlans,
        *,
        param_groups,
        optimizer_factory,
        scheduler_factory,
        mesh,
        training_dataloader=None,
    ):
        super().__init__()
        self.config = config  # DeepSpeed's `engine.config`: what the accessor facade reports
        self.plans = plans
        self.precision = plans.precision
        self.mesh = mesh
        self.dp_group = mesh.group("dp")
        self.accelerator = get_accelerator()
        self.local_rank = comm.get_local_rank()
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.dp_world_size = mesh.size("dp")
        self.device = self.accelerator.torch_device(self.local_rank)

        self.module = module.to(self.device)
        reduction = reduction_groups(param_groups, mesh, plans.zero.mics_shard_size)
        self.trained_sizes = TrainedSizes.of(self.module, param_groups, reduction)  # for memory_breakdown
        self.param_group_names = param_group_names(module, param_groups)
        broadcast_model(self.module, param_groups, reduction, self.dp_group)
        # The strategy snapshots fp32 masters before the model is cast to 16-bit.
        self.zero = build_strategy(
            plans.zero,
            param_groups,
            reduction,
            module=self.module,
            precision=self.precision,
            device=self.device,
            norm_group=mesh.group("dp_sp"),
        )
        weight_tensor_parallel_norm(self.module, self.zero, mesh)
        if self.precision.mixed:
            cast_model(self.module, self.precision.param_dtype, plans.buffer_dtype)
        self.optimizer = optimizer_factory(self.zero)
        if hasattr(self.optimizer, "bind_engine"):  # 1-bit optimizers steer enable_backward_allreduce
            self.optimizer.bind_engine(self)
        self.zero.bind_optimizer(self.optimizer)  # the optimizer whose states the safe_get_* accessors read
        if getattr(self.zero, "plan", None) is not None and self.zero.plan.optimizer != "none":
            use_fused_cpu_step(self.optimizer)  # the offloaded step: torch's fused CPU Adam on flat shards
        self.lr_scheduler = scheduler_factory(self.optimizer)
        self.loss_scaler = plans.loss_scale.build() if plans.loss_scale is not None else None
        self.training_dataloader = training_dataloader

        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self._state_offloader = None  # engine.offload_states() creates it (runtime/state_offload.py)
        self._clip = plans.gradient_clipping
        self._skip_nonfinite = plans.skip_nonfinite
        # curriculum, progressive layer drop, random-LTD (the Engine adds compression): runtime/hooks.py
        self.step_hooks = build_step_hooks(plans.schedules)
        # timers, flops profiler, monitors, comm report, the steps_per_print line (all off by default)
        self.observer = EngineObserver.for_engine(self)

    @property
    def mpu(self):
        """The parallel layout as a DeepSpeed/Megatron `mpu` object (get_data_parallel_group(), ...)."""
        return self.mesh.as_mpu()

    # -- batch sizes (`engine.config` holds them: `set_train_batch_size` changes them there) ----------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self._clip

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    cur_scale = loss_scale

    def scale_loss(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """`loss` / gradient_accumulation_steps, times the fp16 loss scale: what backward runs on."""
        scaled = loss
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            scaled = scaled / gas
        if self.loss_scaler is not None:
            scaled = scaled.float() * self.loss_scaler.scale
        return scaled

    # -- the optimizer step at an accumulation boundary --------------------------------------------
    def grad_norm(self) -> float:
        """The global gradient norm, unscaled (every strategy's norm is already global)."""
        return self.zero.global_grad_norm() / self.loss_scale

    def take_model_step(self, lr_kwargs: dict | None = None, *, samples: int | None = None) -> None:
        """Reduce, unscale, check overflow, clip, step, schedule, update the loss scale, zero gradients;
        count `samples` (default: train_batch_size; Note [caller-managed accumulation] counts backwards)."""
        self._check_states_resident("engine.step")
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step(): no optimizer — give initialize() an optimizer or an `optimizer` section in the config"
            )
        with self.observer.phase("step.reduce"):
            self.zero.finish_reduction()
        scale = self.loss_scale
        with self.observer.phase("step.grad_norm"):
            norm = self.grad_norm()
        # the norm is all-reduced: an inf or nan on any rank is on every rank, so all skip together
        overflow = self._skip_nonfinite and not math.isfinite(norm)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        else:
            if self.zero.transform_gradients(self.optimizer, scale):  # Note [Muon on ZeRO shards] (optim/muon.py)
                norm = self.grad_norm()  # DeepSpeed's ZeRO 1-3 take the norm, and clip, over Muon's update
            self._global_grad_norm = norm
            with self.observer.phase("step.optimizer"):
                self.zero.step(self.optimizer, clip_coefficient(norm, self._clip) / scale)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
            if overflow:
                logger.info(
                    "step %d: fp16 gradient overflow on some rank; step skipped, loss scale %g -> %g",
                    self.global_steps,
                    scale,
                    self.loss_scaler.scale,
                )
        elif overflow:
            logger.info(
                "step %d: inf/nan bf16 gradient on some rank (bf16.check_grad_overflow); step skipped",
                self.global_steps,
            )
        self.zero.zero_grads()
        self.global_steps += 1
        self.global_samples += self.train_batch_size() if samples is None else samples
        self.observer.on_model_step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine's buffers and any stray .grad)."""
        self.zero.zero_grads()
        self.module.zero_grad(set_to_none=set_to_none)

    def destroy(self) -> None:
        """End of training: log the comm totals, close monitors, remove NVMe swap files."""
        self.observer.close()
        self.zero.close()

    def _check_states_resident(self, what: str) -> None:
        """Note [offloaded states] (offload/states.py): nothing runs on states `offload_states` moved away."""
        if self._state_offloader is not None and self._state_offloader.active:
            refuse_offloaded(what, self._state_offloader)

    def checkpoint_state(self) -> TrainingState:
        """What a checkpoint saves and restores (zerospeed.checkpoint never sees the engine); the engine's
        own step counts are the live counters a load sets (Note [live counters] in checkpoint/state.py)."""
        return TrainingState(
            module=self.module,
            zero=self.zero,
            optimizer=self.optimizer,
            mesh=self.mesh,
            counters=self,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            param_dtype=self.precision.param_dtype,
            master_dtype=self.precision.master_dtype,
            ds_config=self.config.model_dump(mode="json"),
            tag_validation=self.config.checkpoint.tag_validation,
            lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler,
            data_sampler=self.training_dataloader,
            random_ltd=scheduler_of(self.step_hooks, RandomLTDHook),
            param_group_names=self.param_group_names,
            delayed_update=delayed_stepper(self.zero),
        )

    # -- module passthrough ------------------------------------------------------------------------
    def __getattr__(self, name: str):
        """Note [attribute pass-through]: DeepSpeed's engine answers an attribute it does not have with the
        wrapped module's (`engine.id`, `engine.config_class`, a model's helper methods), and user code relies
        on it. The engine's own attributes win (they never reach `__getattr__`); an engine property that
        raises AttributeError inside keeps its error rather than silently reading the module's."""
        try:
            return super().__getattr__(name)  # nn.Module's: registered parameters, buffers, submodules
        except AttributeError as own:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__") or hasattr(type(self), name):
                raise own
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(
                    f"{type(self).__name__!r} object (nor its {type(module).__name__} module) has no attribute {name!r}"
                ) from None

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
