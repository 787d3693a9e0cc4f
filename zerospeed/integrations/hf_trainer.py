"""A transformers `Trainer` that trains through a zerospeed Engine.

The Trainer keeps everything it is good at (data loading and sharding through accelerate, logging,
callbacks, evaluation, checkpoint rotation, `trainer_state.json`, RNG files); the Engine does what
DeepSpeed would: forward, backward and step on every micro-batch, with accumulation, clipping,
loss scaling, the optimizer and the LR scheduler at accumulation boundaries.

Note [one step, not two]: the Trainer's loop still calls `optimizer.step()`, `lr_scheduler.step()`,
gradient clipping and `model.zero_grad()` at each boundary. The engine has already done all of that
inside `engine.step()`, so the Trainer is handed views whose `step()` does nothing
(`EngineOptimizer`, `EngineScheduler`), its clipping hook returns the engine's pre-clip norm, and
the loss goes to `engine.backward(..., scale_wrt_gas=False)` because the Trainer has already divided
it by the accumulation steps (the same contract as DeepSpeed under accelerate).

Note [boundaries]: the engine's boundary is set from the Trainer's `sync_gradients` flag every
micro-batch, so the short last accumulation window of an epoch steps in both (as accelerate does
for DeepSpeed); within a window the engine's own count agrees with the Trainer's.

Note [Trainer sequence parallelism]: with `"sequence_parallel_size": P` in the config the Trainer
turns Ulysses on by itself (docs/sequence_parallel.md): the model's attention is registered
(`UlyssesSPAttentionHF`), the train loader — accelerate's, one shard per rank — is wrapped in
DeepSpeed's `UlyssesSPDataLoaderAdapter` (so P ranks train each batch together and the Trainer's
epoch and step counts see the P-times longer loader), the model's loss becomes the sequence-parallel
one, and the "auto" batch sizes count data-parallel ranks only. The Trainer passes
`num_items_in_batch` (every rank's shard tokens, summed over all ranks) and multiplies by the
number of processes; the loss then divides this rank's token-loss sum by that count, so the engine's
average over data x sequence ranks yields the gradient of the whole batch's mean exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transformers

from zerospeed import comm
from zerospeed.config import ConfigError
from zerospeed.integrations.hf_args import TrainingArguments
from zerospeed.integrations.hf_auto import load_hf_config, resolve_hf_config
from zerospeed.runtime.initialize import initialize
from zerospeed.sequence.data import UlyssesSPDataLoaderAdapter
from zerospeed.sequence.hf import UlyssesSPAttentionHF, install_sequence_parallel_loss

logger = logging.getLogger(__name__)

__all__ = ["EngineOptimizer", "EngineScheduler", "Trainer"]


class EngineOptimizer:
    """The engine's optimizer as the Trainer sees it: readable, but `step`/`zero_grad` are the
    engine's job (Note [one step, not two])."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None) -> None:
        """The engine stepped at the boundary already."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine drops its gradients after each step."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


class EngineScheduler:
    """The engine's LR scheduler as the Trainer sees it: `step` is the engine's job."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        """The engine stepped at the boundary already."""

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)


class LoopModel(torch.nn.Module):
    """What the Trainer's training loop holds: the engine minus `no_sync`.

    Between boundaries the loop enters `model.no_sync()` when the model has one (for DDP); the engine
    has one with a different meaning (skip reduction, refused at stage 2-3), and it accumulates on
    its own anyway. Calls go to the engine; evaluation uses the engine directly.
    """

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def forward(self, *inputs, **kwargs):
        return self.engine(*inputs, **kwargs)


def _require_our_arguments(args: Any) -> None:
    if getattr(args, "deepspeed_plugin", None) is not None and not isinstance(args, TrainingArguments):
        raise ConfigError(
            "transformers.TrainingArguments(deepspeed=...) sets up the deepspeed package; use "
            "zerospeed.integrations.transformers.TrainingArguments instead (same fields)"
        )


class Trainer(transformers.Trainer):
    """transformers' `Trainer`; with `args.deepspeed` set it trains through a zerospeed Engine.

    Without a `deepspeed` config it is transformers' Trainer unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.engine = None
        self._sp_mpu = None  # Note [Trainer sequence parallelism]
        super().__init__(*args, **kwargs)
        _require_our_arguments(self.args)

    @property
    def zerospeed_enabled(self) -> bool:
        return bool(getattr(self.args, "deepspeed", None))

    # -- building the engine ------------------------------------------------------------------------
    def zerospeed_config(self, total_steps: int | None) -> dict[str, Any]:
        """The user's config with the Trainer's values for every "auto" (see `hf_auto`)."""
        dp_world = comm.get_world_size() // self._sequence_parallel_size()
        cfg = resolve_hf_config(
            self.args.deepspeed, self.args, getattr(self.model, "config", None), dp_world, total_steps
        )
        if "optimizer" not in cfg:
            # the Trainer's optimizer (AdamW by default) is what the user asked for; as in transformers'
            # DeepSpeed integration it is allowed with ZeRO without a separate opt-in
            cfg["zero_allow_untested_optimizer"] = True
        return cfg

    def _sequence_parallel_size(self) -> int:
        if not self.zerospeed_enabled:
            return 1
        return int(load_hf_config(self.args.deepspeed).get("sequence_parallel_size", 1))

    def _sequence_parallel_mpu(self):
        """The mpu of the sequence-parallel layout, registering Ulysses once (Note [Trainer sequence parallelism])."""
        sp = self._sequence_parallel_size()
        if sp == 1 or self._sp_mpu is not None:
            return self._sp_mpu
        implementation = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        self._sp_mpu = UlyssesSPAttentionHF.register_with_transformers(
            self.model, implementation, sp, self.args.per_device_train_batch_size
        )
        install_sequence_parallel_loss(self.model, self._sp_mpu.get_sequence_parallel_group())
        return self._sp_mpu

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        mpu = self._sequence_parallel_mpu()
        if mpu is None:
            return loader
        pad = getattr(self.model.config, "pad_token_id", None)
        return UlyssesSPDataLoaderAdapter(
            loader,
            mpu.get_sequence_parallel_rank(),
            mpu.get_sequence_parallel_group(),
            mpu.get_sequence_parallel_world_size(),
            self.args.device,
            pad_token_id=pad if isinstance(pad, int) else 0,
        )

    def _trainer_scheduler(self, total_steps: int):
        """A callable(optimizer) -> the Trainer's scheduler on the engine's optimizer."""

        def build(optimizer):
            self.lr_scheduler = None
            return self.create_scheduler(num_training_steps=total_steps, optimizer=optimizer)

        return build

    def _build_engine(self, total_steps: int):
        cfg = self.zerospeed_config(total_steps)
        optimizer = None if "optimizer" in cfg else self.create_optimizer()
        scheduler = None if "scheduler" in cfg else self._trainer_scheduler(total_steps)
        engine, opt, _, sched = initialize(
            model=self.model, config=cfg, optimizer=optimizer, lr_scheduler=scheduler, mpu=self._sequence_parallel_mpu()
        )
        self.engine = engine
        self.optimizer = EngineOptimizer(opt)
        self.lr_scheduler = EngineScheduler(sched) if sched is not None else None
        self.model_wrapped = self.deepspeed = engine
        return engine

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if not self.zerospeed_enabled:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.engine is None:
            self._build_engine(max_steps)
        if resume_from_checkpoint is not None:
            self._load_engine_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return LoopModel(self.engine), train_dataloader

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.engine is not None:
            return self.engine  # evaluation runs through the engine: at stage 3 its forward gathers
        if self.zerospeed_enabled and not training and self.engine is None and _zero_stage(self.args.deepspeed) == 3:
            raise ConfigError(
                "evaluate()/predict() before train() at ZeRO stage 3: the engine that gathers the "
                "sharded parameters is built by train(); call train() first (max_steps=0 is enough)"
            )
        return super()._wrap_model(model, training, dataloader)

    # -- the step --------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.zerospeed_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not self._loss_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        boundary = self.accelerator.sync_gradients
        engine.set_gradient_accumulation_boundary(boundary)  # Note [boundaries]
        if boundary:
            self._zs_lr = engine.get_lr()[0]  # the lr this step uses, for the log
        engine.backward(loss, scale_wrt_gas=False)  # Note [one step, not two]
        engine.step()
        return loss.detach()

    def _loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        # the Trainer's own rule: a loss normalised by the token count of the whole accumulated batch
        # (the model took `num_items_in_batch`) or by the user's loss function is not divided again
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        )

    def _clip_grad_norm(self, model):
        if not self.zerospeed_enabled:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()  # the engine clipped already; this is the pre-clip norm

    def _get_grad_norm(self, model, grad_norm=None):
        if not self.zerospeed_enabled:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()

    def _get_learning_rate(self) -> float:
        if not self.zerospeed_enabled or self.engine is None:
            return super()._get_learning_rate()
        return getattr(self, "_zs_lr", None) or self.engine.get_lr()[0]

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A consolidated transformers model dir (`from_pretrained` loads it); collective."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine.zero_optimization_stage() == 3:
            state_dict = self.engine.zero.full_state_dict()  # gathered unit by unit onto rank 0
        else:
            state_dict = self.engine.module.state_dict()
        self._save(output_dir, state_dict=state_dict)
        comm.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # model + optimizer + scheduler + loss scaler + counters, sharded, in output_dir/global_step{N}
        self.engine.save_checkpoint(output_dir)

    def _load_engine_checkpoint(self, checkpoint: str) -> None:
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r}: no zerospeed checkpoint there (no 'latest' "
                "file); it must be a checkpoint-N dir written by this Trainer with a deepspeed config"
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self.zerospeed_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # the engine loads weights with the optimizer state once it exists (`_prepare_for_training`)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.zerospeed_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        self.engine.load_checkpoint(
            best, load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
        )


def _zero_stage(config: Any) -> int:
    stage = load_hf_config(config).get("zero_optimization", {}).get("stage", 0)
    return int(stage) if not isinstance(stage, str) else 0
