"""The trial side of the autotuner: what a training process measures when ``zerospeed --autotuning``
launched it, and the file it leaves for the autotuner (``zerospeed/autotuning``) to read.

The engine's observer (`EngineObserver.for_engine`) builds the probe and calls it at the end of every
step: the autotuner attaches to training through the observer, as every measuring tool does, and the
engine knows nothing of it. The autotuner sets one of two environment variables for the processes of
a trial; without them `trial_probe_for` returns None and nothing happens (the ``autotuning`` config
block is otherwise ignored inside a training run, as DeepSpeed ignores it without ``--autotuning``):

- ``ZEROSPEED_AUTOTUNING_METRIC_PATH``: time the optimizer steps ``start_profile_step`` ..
  ``end_profile_step`` (the ``autotuning`` block of the trial's config), count one forward pass's
  FLOPs, write DeepSpeed's ``metrics.json`` keys (``latency`` ms per step, ``throughput`` samples/s,
  ``FLOPS_per_gpu``) from rank 0 and end the process with exit code 0 at ``end_profile_step``, as
  DeepSpeed's engine does.
- ``ZEROSPEED_AUTOTUNING_MODEL_INFO_PATH``: the model-information run. Write the parameter count,
  the largest layer, the bytes per parameter of each model state, this rank's device memory and
  the activation bytes of the first forward pass, then exit 0.

Note [activation census]: activation memory is counted as the bytes of the distinct storages autograd
saves for backward during one forward pass (``saved_tensors_hooks``), parameters excluded. That is
what stays alive between forward and backward on any device (CPU included, where the allocator
keeps no statistics); temporaries freed inside the forward are not counted, which the planner's
headroom covers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from zerospeed.estimate.census import census_of_module
from zerospeed.profiling.profiler import FlopsProfiler
from zerospeed.zero.memory import OPTIMIZER_STATE_BYTES, optimizer_kind

ENV_METRIC_PATH = "ZEROSPEED_AUTOTUNING_METRIC_PATH"
ENV_MODEL_INFO_PATH = "ZEROSPEED_AUTOTUNING_MODEL_INFO_PATH"


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Write JSON to a temporary name and rename it, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def step_metrics(
    step_seconds: list[float], train_batch_size: int, gas: int, forward_flops: int | None
) -> dict[str, float]:
    """DeepSpeed's metrics from per-step wall times: latency (ms per optimizer step), throughput
    (samples/s), FLOPS_per_gpu (a forward's FLOPs x 3 for forward + backward x gas per step)."""
    if not step_seconds:
        raise ValueError("no profiled steps")
    latency_s = sum(step_seconds) / len(step_seconds)
    out = {"latency": latency_s * 1e3, "throughput": train_batch_size / latency_s}
    if forward_flops:
        out["FLOPS_per_gpu"] = forward_flops * 3 * gas / latency_s
    return out


class _SavedTensorCensus:
    """Note [activation census]: distinct storages saved for backward, parameters excluded."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # a parameter (or a view of one)
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class TrialProbe:
    """Hooks one engine: forward hooks on its module, and `on_step` after every optimizer step."""

    def __init__(
        self, engine, *, metric_path: str | None = None, model_info_path: str | None = None, clock=time.perf_counter
    ) -> None:
        self.engine = engine
        self.metric_path = metric_path
        self.model_info_path = model_info_path
        self._clock = clock
        at = engine.config.autotuning
        self.start, self.end = at.start_profile_step, at.end_profile_step
        if self.end < self.start:
            raise ValueError(f"autotuning.end_profile_step={self.end} is before start_profile_step={self.start}")
        self.step_seconds: list[float] = []
        self._mark: float | None = None
        self.forward_flops: int | None = None
        self._profiler = None
        self._census: _SavedTensorCensus | None = None
        self._forwards = 0
        module = engine.module
        if metric_path and (self.start > 1 or at.metric == "flops"):
            self._start_flops_count()  # hooks first, so that ours below runs after the profiler's own
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    # -- hooks --------------------------------------------------------------------------------------
    def _start_flops_count(self) -> None:
        self._profiler = FlopsProfiler(self.engine.module, self.engine)
        self._profiler.start_profile()

    def _before_forward(self, module, inputs) -> None:
        self._forwards += 1
        if self._forwards != 1:
            return
        if self.metric_path and self.start == 1:
            self._mark = self._now()
        if self.model_info_path:
            self._census = _SavedTensorCensus().__enter__()

    def _after_forward(self, module, inputs, output) -> None:
        if self._forwards != 1:
            return
        if self._profiler is not None:
            self._profiler.stop_profile()
            self.forward_flops = self._profiler.get_total_flops()
            self._profiler.end_profile()
            self._profiler = None
        if self._census is not None:
            self._census.__exit__(None, None, None)
            self._write(self.model_info_path, self.model_info(self._census.nbytes))
            raise SystemExit(0)  # the model-information run ends here

    def on_step(self, engine) -> None:
        """After a step that crossed an accumulation boundary (the observer's `on_step_end`); ends the process
        at end_profile_step."""
        if not self.metric_path:
            return
        step = engine.global_steps
        if step == self.start - 1:
            self._mark = self._now()
        elif self.start <= step <= self.end and self._mark is not None:
            now = self._now()
            self.step_seconds.append(now - self._mark)
            self._mark = now
        if step >= self.end:
            self._write(self.metric_path, self.metrics())
            raise SystemExit(0)  # as DeepSpeed's engine exits after end_profile_step

    # -- results ------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        e = self.engine
        out: dict[str, Any] = step_metrics(
            self.step_seconds, e.train_batch_size(), e.gradient_accumulation_steps(), self.forward_flops
        )
        out.update(
            steps=[self.start, self.end],
            step_seconds=self.step_seconds,
            train_batch_size=e.train_batch_size(),
            train_micro_batch_size_per_gpu=e.train_micro_batch_size_per_gpu(),
            gradient_accumulation_steps=e.gradient_accumulation_steps(),
            zero_stage=e.zero_optimization_stage(),
            world_size=e.world_size,
        )
        return out

    def model_info(self, activation_bytes: int) -> dict[str, Any]:
        e = self.engine
        census = census_of_module(e.module)
        size = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # noqa: E731
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        return {
            "num_params": census.total_params,
            "largest_layer_params": census.largest_layer_params,
            "trainable_num_params": sum({id(p): p.numel() for p in e.module.parameters() if p.requires_grad}.values()),
            "param_bytes": size(e.precision.param_dtype),
            "grad_bytes": size(e.precision.grad_accum_dtype),
            "master_bytes": e.precision.master_bytes,
            "optim_bytes": (
                OPTIMIZER_STATE_BYTES[optimizer_kind(e.optimizer)] * e.precision.master_dtype.itemsize // 4
                if e.optimizer
                else 0
            ),
            "activation_bytes": activation_bytes,
            "micro_batch": e.train_micro_batch_size_per_gpu(),
            "dp_world_size": e.dp_world_size,
            "world_size": e.world_size,
            "local_size": local,
            "device": e.accelerator.name,
            "device_memory": e.accelerator.total_memory(),
        }

    def _now(self) -> float:
        self.engine.accelerator.synchronize()
        return self._clock()

    def _write(self, path: str | None, data: dict[str, Any]) -> None:
        if path and self.engine.global_rank == 0:
            write_json_atomic(path, data)


def trial_probe_for(engine) -> TrialProbe | None:
    """The probe for this process when the autotuner launched it (its environment says so), else None."""
    metric_path = os.environ.get(ENV_METRIC_PATH)
    model_info_path = os.environ.get(ENV_MODEL_INFO_PATH)
    if not (metric_path or model_info_path):
        return None
    return TrialProbe(engine, metric_path=metric_path, model_info_path=model_info_path)
