"""`PipelineEngine`: runs pipeline schedules on the parts every engine is made of.

`EngineCore` (runtime/core.py) provides what the ordinary `Engine` has too — precision policy, the
ZeRO strategy (built over this stage's data-parallel group of the mesh), optimizer, LR scheduler,
loss scaler, clipping and the boundary step (`take_model_step`) — and `DeepSpeedAPI` (runtime/
deepspeed_api.py) DeepSpeed's accessors over them. This class adds only the pipeline:
it executes the instructions of a schedule (schedules.py), moves messages through `Transport`, sums
tied-weight gradients (ties.py), and extends the gradient norm over every stage. It has no
per-micro-batch `backward` / `step`: batches run whole, through `train_batch`.

Note [one reduction per batch]: every micro-batch's backward runs with the strategy's reduction off
(`begin_backward(sync=False)`): gradients accumulate locally in the strategy's fp32 buffers. At
`ReduceGrads` one extra backward feeds each parameter a zero gradient (tied weights: their summed
gradient) with reduction on, which launches the strategy's data-parallel reduction through its own
hooks, in its own order. Gradients cross stages first (tied sums), then ranks (data parallel).

ZeRO-2 keeps no full-size gradient buffer, so there each micro-batch's backward is its own reduction
(`begin_backward` / `end_micro_step` around it, as the ordinary engine does at every micro-step):
its gradients are reduce-scattered into this rank's chunk right away, tied weights' contributions
held back (zeroed by TiedGradients' hook) and reduced at `ReduceGrads` by the same extra backward.
That is m + 1 reduce-scatters per batch of m micro-batches instead of one all-reduce — the price of
gradient memory of 1/dp, which is why DeepSpeed refuses the combination rather than pay it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.parallel.pipeline import schedules as S
from zerospeed.parallel.pipeline.checkpoint import (
    PipelineSaves,
    load_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from zerospeed.parallel.pipeline.module import PipelineModule, non_reentrant_checkpoint
from zerospeed.parallel.pipeline.ties import TiedGradients
from zerospeed.parallel.pipeline.transport import RecvOp, SendOp, Transport, as_tensors
from zerospeed.runtime.checkpoint_saves import writer_plan
from zerospeed.runtime.core import EngineCore
from zerospeed.runtime.deepspeed_api import DeepSpeedAPI
from zerospeed.utils.errors import ConfigAssertionError, ConfigError

logger = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """Misuse of the pipeline engine (e.g. calling forward/backward/step directly)."""


@dataclass
class _BatchState:
    """Tensors in flight during one batch, keyed by (micro-batch, chunk)."""

    train: bool
    compute_loss: bool = True
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    output_grads: dict = field(default_factory=dict)
    input_grads: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    loss_tensors: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    act_bytes: dict = field(default_factory=dict)
    live_bytes: int = 0
    compute_s: float = 0.0


def _repeat(loader) -> Iterator:
    while True:
        yield from loader


class PipelineEngine(DeepSpeedAPI, EngineCore):
    """Trains a `PipelineModule` with 1F1B (interleaved when the module has chunks > 1)."""

    pipeline_enable_backward_allreduce = True
    """DeepSpeed's pipeline form of `enable_backward_allreduce` (the 1-bit optimizers turn it off)."""

    def __init__(self, module: PipelineModule, config, plans, **kwargs):
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(module).__name__}")
        _refuse_what_stages_cannot_run(plans)
        if not config.managed_gradient_accumulation:  # (DeepSpeed asserts it too)
            raise ConfigAssertionError(
                "managed_gradient_accumulation=false is not supported with pipeline parallelism: "
                "train_batch() runs a whole accumulation window itself; set it to true"
            )
        _apply_pipeline_section(module, config.pipeline)
        # Tied-gradient hooks must be registered before the strategy's (Engine.__init__ builds it).
        module.to(get_accelerator().torch_device(comm.get_local_rank()))
        ties = TiedGradients(module)
        ties.broadcast_weights()
        kwargs.setdefault("mesh", module.groups.mesh)
        super().__init__(module, config, plans, **kwargs)
        if plans.schedules.curriculum is not None and self.global_rank == 0:
            logger.warning(
                "pipeline engine: curriculum_learning is not passed to the stages (Note [forward "
                "schedules]); read engine.curriculum_scheduler_legacy in the training loop, as "
                "Megatron-DeepSpeed does"
            )
        self.ties = ties
        self.pp_group = module.groups.group("pp")
        self.transport = Transport(self.device)
        self.num_stages, self.stage_id, self.chunks = module.num_stages, module.stage_id, module.chunks
        me = module.grid.coords(self.global_rank)  # Note [tensor parallelism inside stages] (module.py)
        self._stage_rank = [module.grid.rank(pp=s, dp=me["dp"], tp=me["tp"]) for s in range(self.num_stages)]
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._data_iter: Iterator | None = None
        self.activation_stats = {"peak_bytes": 0, "peak_micro_batches": 0}
        self.last_batch_timing = {"compute_s": 0.0, "wall_s": 0.0}
        self.agg_train_loss: torch.Tensor | None = None
        # "1f1b" (default, interleaved when chunks > 1) or "fill_drain" (GPipe; holds every micro-batch)
        self.train_schedule = "1f1b"
        self._checkpoint_saves = PipelineSaves(writer_plan(config))  # (flush_saves and destroy() find it here)

    # -- queries ----------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        self._data_iter = iterator

    def reset_activation_shape(self) -> None:
        """Renegotiate message shapes on the next batch (call on every rank together)."""
        self.transport.reset()

    def forward(self, *args, **kwargs):
        raise PipelineError(
            "a PipelineEngine runs whole batches: use engine.train_batch(data_iter) or "
            "engine.eval_batch(data_iter) instead of engine(batch)"
        )

    def grad_norm(self) -> float:
        """The norm over every stage: each stage's strategy knows its own (data-parallel reduced)
        norm; tied weights are held by several stages but count once. Under tensor parallelism the
        strategy's norm already spans every rank (Note [norm weights] in zero/strategy.py), stages
        included: the tied duplicates are then summed over every rank too, each data-parallel copy 1/dp."""
        weights = self.zero.norm_weights
        dup = torch.tensor([self.ties.duplicate_sq_norm], dtype=torch.float64, device=self.device)
        if weights is not None:
            dup /= self.dp_world_size
            comm.all_reduce(dup, op="sum")
            total = self.zero.global_grad_norm() ** 2 - float(dup.item())
        else:
            t = self.zero.global_grad_norm() ** 2 - dup
            comm.all_reduce(t, op="sum", group=self.pp_group)
            total = float(t.item())
        return (math.sqrt(max(total, 0.0)) if math.isfinite(total) else total) / self.loss_scale

    # -- batches ----------------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() called under torch.no_grad(); use eval_batch() to evaluate")
        self.module.train()
        m = self.gradient_accumulation_steps()
        if self.train_schedule not in ("1f1b", "fill_drain"):
            raise PipelineError(f"train_schedule={self.train_schedule!r}: expected '1f1b' or 'fill_drain'")
        schedule = (
            S.one_f_one_b(self.stage_id, self.num_stages, m, self.chunks)
            if self.train_schedule == "1f1b"
            else S.fill_drain(self.stage_id, self.num_stages, m, self.chunks, train=True)
        )
        state = _BatchState(train=True)
        self.zero.begin_backward(sync=False)  # Note [one reduction per batch]
        self._execute(schedule, self._iterator(data_iter), state)
        self.agg_train_loss = self._aggregate_loss(state.losses)
        if self._checkpoint_saves.in_flight():  # Note [asynchronous pipeline saves]: a written save commits
            self._checkpoint_saves.poll()
        return self.agg_train_loss

    def eval_batch(
        self, data_iter, return_logits: bool = False, compute_loss: bool = True, num_micro_batches: int | None = None
    ):
        """Forward-only fill-drain over the micro-batches; the mean loss on every stage.

        With `return_logits`, returns (loss, logits): the last stage's outputs concatenated over the
        micro-batches, None on other stages.
        """
        was_training = self.module.training
        self.module.eval()
        m = num_micro_batches or self.gradient_accumulation_steps()
        state = _BatchState(train=False, compute_loss=compute_loss)
        with torch.no_grad():
            self._execute(
                S.fill_drain(self.stage_id, self.num_stages, m, self.chunks),
                iter(data_iter) if not hasattr(data_iter, "__next__") else data_iter,
                state,
            )
        self.module.train(was_training)
        loss = self._aggregate_loss(state.losses) if compute_loss else None
        if return_logits:
            return loss, (torch.cat(state.logits) if state.logits else None)
        return loss

    def _iterator(self, data_iter):
        if data_iter is not None:
            return data_iter
        if self._data_iter is None:
            if self.training_dataloader is None:
                raise PipelineError("train_batch(): no data_iter and no training_data given to initialize()")
            self._data_iter = _repeat(self.training_dataloader)
        return self._data_iter

    def _aggregate_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches and data-parallel ranks, sent from the last stage to all stages."""
        if self.is_last_stage():
            loss = torch.stack(losses).float().mean().reshape(1) if losses else torch.zeros(1, device=self.device)
            comm.all_reduce(loss, op="avg", group=self.dp_group)
        else:
            loss = torch.zeros(1, device=self.device)
        comm.broadcast(loss, src=self._stage_rank[-1], group=self.pp_group)
        return loss[0]

    # -- the interpreter --------------------------------------------------------------------------
    def _execute(self, schedule, data_iter, state: _BatchState) -> None:
        start, batch = time.perf_counter(), []
        for instr in schedule:
            if S.is_comm(instr):
                batch.append(instr)
                continue
            if batch:
                self._communicate(batch, state)
                batch = []
            if isinstance(instr, S.ReduceTiedGrads):
                self.last_batch_timing = {"compute_s": state.compute_s, "wall_s": time.perf_counter() - start}
            self._dispatch(instr, data_iter, state)
        if batch:
            self._communicate(batch, state)
        if not state.train:
            self.last_batch_timing = {"compute_s": state.compute_s, "wall_s": time.perf_counter() - start}

    def _vs(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _is_last_vs(self, chunk: int) -> bool:
        return self._vs(chunk) == self.num_stages * self.chunks - 1

    def _communicate(self, instrs: list[S.Instruction], state: _BatchState) -> None:
        mode = "train" if state.train else "eval"
        nxt = self._stage_rank[(self.stage_id + 1) % self.num_stages]
        prev = self._stage_rank[(self.stage_id - 1) % self.num_stages]
        ops = []
        for ins in instrs:
            key, vs = (ins.micro_batch, ins.chunk), self._vs(ins.chunk)
            if isinstance(ins, S.SendActivation):
                out = state.outputs[key] if state.train else state.outputs.pop(key)
                ops.append(SendOp(("act", vs, mode), out, nxt))
            elif isinstance(ins, S.RecvActivation):
                ops.append(RecvOp(("act", vs - 1, mode), prev))
            elif isinstance(ins, S.SendGrad):
                ops.append(SendOp(("grad", vs, mode), state.input_grads.pop(key), prev))
            else:
                ops.append(RecvOp(("grad", vs + 1, mode), nxt))
        for ins, value in zip(instrs, self.transport.run(ops)):
            key = (ins.micro_batch, ins.chunk)
            if isinstance(ins, S.RecvActivation):
                state.inputs[key] = value
            elif isinstance(ins, S.RecvGrad):
                state.output_grads[key] = value

    def _dispatch(self, ins: S.Instruction, data_iter, state: _BatchState) -> None:
        if isinstance(ins, S.LoadMicroBatch):
            self._load(ins, data_iter, state)
        elif isinstance(ins, S.ForwardPass):
            t0 = time.perf_counter()
            self._forward(ins, state)
            state.compute_s += time.perf_counter() - t0
        elif isinstance(ins, S.BackwardPass):
            t0 = time.perf_counter()
            self._backward(ins, state)
            state.compute_s += time.perf_counter() - t0
        elif isinstance(ins, S.ReduceTiedGrads):
            self.ties.reduce(self.dp_group, self.zero.norm_weights)
        elif isinstance(ins, S.ReduceGrads):
            self._hand_grads_to_strategy()
        elif isinstance(ins, S.OptimizerStep):
            self.take_model_step()
            self.micro_steps += self.gradient_accumulation_steps()
            self.ties.zero()
        else:
            raise PipelineError(f"unknown instruction {ins!r}")

    def _load(self, ins: S.LoadMicroBatch, data_iter, state: _BatchState) -> None:
        batch = next(data_iter)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise PipelineError(
                "pipeline data must yield (inputs, labels) pairs; got "
                f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else len(batch)}"
            )
        if self._vs(ins.chunk) == 0:
            state.inputs[(ins.micro_batch, ins.chunk)] = _to(batch[0], self.device)
        if self._is_last_vs(ins.chunk):
            state.labels[ins.micro_batch] = _to(batch[1], self.device)

    def _forward(self, ins: S.ForwardPass, state: _BatchState) -> None:
        key = (ins.micro_batch, ins.chunk)
        x = state.inputs[key] if state.train else state.inputs.pop(key)
        if state.train:
            out, nbytes = self._forward_measured(ins.chunk, x)
            state.act_bytes[key] = nbytes
            state.live_bytes += nbytes
            self.activation_stats["peak_bytes"] = max(self.activation_stats["peak_bytes"], state.live_bytes)
            self.activation_stats["peak_micro_batches"] = max(
                self.activation_stats["peak_micro_batches"], len(state.act_bytes)
            )
        else:
            out = self.module.forward_chunk(ins.chunk, x)
        if not self._is_last_vs(ins.chunk):
            state.outputs[key] = out
            return
        if not state.train and not state.compute_loss:
            state.logits.append(out)
            return
        labels = state.labels.pop(ins.micro_batch)
        loss = self.module.loss_fn(out, labels) if self.module.loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError("the last stage must produce a scalar loss (give PipelineModule a loss_fn)")
        state.losses.append(loss.detach())
        if state.train:
            state.loss_tensors[ins.micro_batch] = loss
        else:
            state.logits.append(out)

    def _forward_measured(self, chunk: int, x: Any):
        """Run the chunk, counting the bytes autograd saves for backward (parameters excluded)."""
        seen: set[int] = set()
        total = [0]

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storages and ptr not in seen:
                seen.add(ptr)
                total[0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.module.forward_chunk(chunk, x)
        return out, total[0]

    def _backward(self, ins: S.BackwardPass, state: _BatchState) -> None:
        reduce_now = not self.zero.supports_no_sync  # ZeRO-2: Note [one reduction per batch]
        if reduce_now:  # (stage 2 reduces every micro-step anyway; the batch's last gradients are ReduceGrads')
            self.zero.begin_backward(sync=False)
        self._run_backward(ins, state)
        if reduce_now:
            self.zero.end_micro_step()

    def _run_backward(self, ins: S.BackwardPass, state: _BatchState) -> None:
        key = (ins.micro_batch, ins.chunk)
        if self._is_last_vs(ins.chunk):
            loss = state.loss_tensors.pop(ins.micro_batch)
            self.scale_loss(loss).backward()
        else:
            _, outs = as_tensors(state.outputs.pop(key), "stage output")
            outs = [t for t in outs if t.is_floating_point() and t.requires_grad]
            _, grads = as_tensors(state.output_grads.pop(key), "received gradient")
            if len(outs) != len(grads):
                raise PipelineError(
                    f"micro-batch {ins.micro_batch}: {len(outs)} outputs need gradients but {len(grads)} arrived"
                )
            if outs:
                torch.autograd.backward(outs, grads)
        _, inputs = as_tensors(state.inputs.pop(key), "stage input")
        state.live_bytes -= state.act_bytes.pop(key, 0)
        if self._vs(ins.chunk) > 0:
            state.input_grads[key] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad
            )

    def _hand_grads_to_strategy(self) -> None:
        """Note [one reduction per batch]: a zero-gradient backward that launches the reduction."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [self.ties.acc[id(p)].to(p.dtype) if id(p) in self.ties.acc else torch.zeros_like(p) for p in params]
        self.ties.capturing = False
        try:
            self.zero.begin_backward(sync=self.pipeline_enable_backward_allreduce)
            torch.autograd.backward(params, grads)
        finally:
            self.ties.capturing = True
        for p in params:
            p.grad = None  # parameters outside the optimizer's groups keep no stray gradient

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(
        self, save_dir, tag=None, client_state=None, save_latest: bool = True, exclude_frozen_parameters: bool = False
    ):
        return save_pipeline_checkpoint(
            self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest, saves=self._checkpoint_saves
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        self._checkpoint_saves.flush()  # a save in flight commits first: its tag may be the one asked for
        return load_pipeline_checkpoint(
            self,
            load_dir,
            tag=tag,
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            universal=self.config.checkpoint.load_universal,
        )


def _apply_pipeline_section(module: PipelineModule, section) -> None:
    """The config's `pipeline` block, as DeepSpeed's engine reads it: `use_reentrant` (default true)
    picks the module's checkpoint function, `activation_checkpoint_interval > 0` overrides the
    module's own (Note [pipeline activation checkpointing] in parallel/pipeline/module.py).

    `stages`, `partition` and `seed_layers` shape a module that is already built when `initialize`
    sees the config: DeepSpeed's engine never reads them (the module's own arguments decide). They
    are accepted; a value that disagrees with the module is logged, naming the module's argument."""
    if section.use_reentrant is False:
        module.activation_checkpoint_func = non_reentrant_checkpoint
    if section.activation_checkpoint_interval > 0:
        module.set_checkpoint_interval(section.activation_checkpoint_interval)
    methods = {section.partition.lower(), module.partition_method.lower()}
    differs = {
        "stages": section.stages not in ("auto", module.num_stages),
        "partition": len(methods) > 1 and methods != {"best", "parameters"},
        "seed_layers": section.seed_layers and not module.seed_layers,
    }
    module_arg = {"stages": "num_stages", "partition": "partition_method", "seed_layers": "seed_layers"}
    for key in (k for k, d in differs.items() if d and comm.get_rank() == 0):
        logger.warning(
            "pipeline.%s=%r is not what the PipelineModule was built with (%s=%r): the module's argument "
            "decides, as in DeepSpeed; pass it to PipelineModule(...)",
            key,
            getattr(section, key),
            module_arg[key],
            module.num_stages if key == "stages" else getattr(module, module_arg[key]),
        )


def _refuse_what_stages_cannot_run(plans) -> None:
    """The plans a pipeline cannot honour: its engine runs the stages itself (Note [forward schedules])."""
    if plans.zero.stage >= 3:
        raise ConfigError(
            "zero_optimization.stage=3 cannot be combined with pipeline parallelism: a stage's "
            "parameters would be gathered and released once per micro-batch and per direction "
            "across the schedule; use stage 0, 1 or 2 (stage 2 shards gradients and optimizer "
            "states over the stage's data-parallel ranks)"
        )
    if plans.precision.autocast_dtype is not None:
        raise ConfigError(
            "torch_autocast.enabled=true with a PipelineModule: the pipeline engine runs its "
            "stages itself, outside the engine's autocast forward; use bf16 / fp16 instead, or "
            "the plain engine"
        )
    if plans.schedules.layer_drop is not None:  # (DeepSpeed's pipeline engine never updates it either)
        raise ConfigError(
            "progressive_layer_drop.enabled=true with a PipelineModule: the pipeline engine runs "
            "its stages itself and passes no pld_theta to them; use the plain engine or turn it off"
        )
    if plans.schedules.random_ltd is not None:  # (DeepSpeed's pipeline stages never bind random-LTD layers)
        raise ConfigError(
            "data_efficiency.data_routing.random_ltd.enabled=true with a PipelineModule: the "
            "pipeline engine does not drive random-LTD layers; use the plain engine or turn it off"
        )


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value
