"""`EngineObserver`: the one object through which the engine runs every observability tool.

The engine calls, around each micro-step:

    on_forward_start(engine, *inputs)   on_forward_end(engine)
    on_backward_start(engine, loss)     on_backward_end(engine)
    on_step_start(engine)               on_step_end(engine)
    close()                             at the end of training

and the observer sequences the tools the config enables: the flops profiler (`flops_profiler`, on
rank 0 at `profile_step`; under tensor parallelism on every rank, for the model totals, printed by
rank 0), phase timers (`wall_clock_breakdown`), the comm report
(`comms_logger`, from `zerospeed.comm.STATS`), the monitors (`tensorboard`, `csv_monitor`, `wandb`,
`comet`, written by rank 0), the `steps_per_print` progress line and `memory_breakdown`. With every
tool off, `active` is False and each hook returns at once. When `zerospeed --autotuning` started the
process, the observer also runs the autotuning trial's probe (`trial_probe.py`) after each step.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.moe.layer import moe_monitor_events
from zerospeed.monitor.writers import build_monitors
from zerospeed.profiling.comms_report import diff_snapshots, format_comm_report
from zerospeed.profiling.memory_phases import PhasePeaks
from zerospeed.profiling.peak import current_device_peak
from zerospeed.profiling.profiler import FlopsProfiler
from zerospeed.profiling.report import format_profile
from zerospeed.profiling.timers import PhaseTimers, format_breakdown
from zerospeed.profiling.trial_probe import TrialProbe, trial_probe_for
from zerospeed.utils.errors import ConfigError

logger = logging.getLogger(__name__)
MIB = 2**20


def _tokens(inputs: tuple) -> int | None:
    """Tokens in a micro-batch: the size of a leading integer (B, T) tensor, else unknown."""
    first = inputs[0] if inputs else None
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and not first.is_floating_point():
        return first.numel()
    return None


def _tp_size(engine) -> int:
    mesh = getattr(engine, "mesh", None)
    return mesh.size("tp") if mesh is not None else 1


class EngineObserver:
    """Runs the observability tools a `ZeroSpeedConfig` enables; see the module docstring for the hooks."""

    def __init__(self, config, *, rank: int = 0, clock=time.perf_counter):
        self.config = config
        self.rank = rank
        self._clock = clock
        fp, cl = config.flops_profiler, config.comms_logger
        if cl.enabled and cl.debug:
            raise ConfigError(
                "comms_logger.debug=true: naming the calling function of each collective is not "
                "implemented in zerospeed yet; set it to false"
            )
        self.profile = fp.enabled
        self.timing = config.wall_clock_breakdown or fp.enabled
        self.comms = cl.enabled
        self.monitors = build_monitors(config) if rank == 0 else []
        self.monitoring = any(
            (config.tensorboard.enabled, config.csv_monitor.enabled, config.wandb.enabled, config.comet.enabled)
        )
        self.every = config.steps_per_print
        self.active = any((self.profile, self.timing, self.comms, self.monitoring, self.every, config.memory_breakdown))
        self.timers = PhaseTimers()
        self.profiler: FlopsProfiler | None = None
        self._losses: list[float] = []
        self._tokens = 0
        self._samples_since = 0
        self._last_time: float | None = None
        self._comm_mark = comm.STATS.snapshot()
        self._steps_since_print = 0
        self._step_at_start = 0
        self.memory_phases: PhasePeaks | None = None  # per-phase peaks with memory_breakdown (for_engine)
        self.trial_probe: TrialProbe | None = None  # an autotuning trial's measurement (for_engine)

    @classmethod
    def for_engine(cls, engine) -> EngineObserver:
        """Build from an engine's parsed config and rank (what `Engine.__init__` calls)."""
        obs = cls(engine.config, rank=engine.global_rank)
        obs.timers = PhaseTimers(engine.accelerator.synchronize)
        if engine.config.memory_breakdown:
            obs.memory_phases = PhasePeaks(engine.accelerator)
        obs.trial_probe = trial_probe_for(engine)  # None unless `zerospeed --autotuning` started this process
        return obs

    # -- forward / backward -------------------------------------------------------------------------
    def on_forward_start(self, engine, *inputs) -> None:
        if not self.active:
            return
        if self._last_time is None:
            self._last_time = self._clock()
        self._tokens += _tokens(inputs) or 0
        if self._profiling_now(engine) and self.profiler is None:
            self.profiler = FlopsProfiler(
                engine.module, engine, recompute_fwd_factor=self.config.flops_profiler.recompute_fwd_factor
            )
            self.profiler.start_profile()
        if self.timing:
            self.timers.start("forward")
        if self.memory_phases is not None:
            self.memory_phases.enter("forward")

    def on_forward_end(self, engine) -> None:
        if not self.active:
            return
        if self.timing:
            self.timers.stop("forward")
        if self.memory_phases is not None:
            self.memory_phases.leave()
        if self.profiler is not None and self.profiler.running:
            self.profiler.stop_profile()  # count one forward pass; backward is 2x by convention

    def on_backward_start(self, engine, loss: torch.Tensor | float | None = None) -> None:
        if not self.active:
            return
        if loss is not None and (self.monitoring or self.every):
            self._losses.append(float(loss.detach().float().item() if isinstance(loss, torch.Tensor) else loss))
        if self.timing:
            self.timers.start("backward")
        if self.memory_phases is not None:
            self.memory_phases.enter("backward")

    def on_reduce_start(self, engine) -> None:
        """Autograd is done; what remains of the backward is waiting for the gradient reductions."""
        if self.memory_phases is not None:
            self.memory_phases.enter("reduce")

    def on_backward_end(self, engine) -> None:
        if self.active and self.timing:
            self.timers.stop("backward")
        if self.memory_phases is not None:
            self.memory_phases.leave()

    # -- optimizer step -------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str):
        """A timed part of a phase (`wall_clock_breakdown`): "step.reduce", "step.grad_norm" and
        "step.optimizer" split an accumulation boundary's step — the last reduction, the global norm,
        and the optimizer over the shards with the parameters' refresh (for offload: the host step and
        the copies). A no-op when timing is off."""
        if not (self.active and self.timing):
            yield
            return
        self.timers.start(name)
        try:
            yield
        finally:
            self.timers.stop(name)

    def on_model_step(self, engine) -> None:
        """After every optimizer step (both engines run it from `take_model_step`): an autotuning trial's
        probe times the step and may end the process."""
        if self.trial_probe is not None:
            self.trial_probe.on_step(engine)

    def on_step_start(self, engine) -> None:
        if not self.active:
            return
        self._step_at_start = engine.global_steps
        if self.timing:
            self.timers.start("step")
        if self.memory_phases is not None:
            self.memory_phases.enter("step")

    def on_step_end(self, engine, *, applied: bool | None = None, loss: float | None = None) -> None:
        """After `engine.step()`; acts when the step crossed an accumulation boundary."""
        if not self.active:
            return
        if self.timing:
            self.timers.stop("step")
        if self.memory_phases is not None:
            self.memory_phases.leave()
        if loss is not None:
            self._losses.append(float(loss))
        if engine.global_steps == self._step_at_start:
            return  # a micro-step inside gradient accumulation
        self._steps_since_print += 1
        self._finish_profile(engine)
        events = self._step_events(engine)
        if self.monitoring:
            events += self._memory_events(engine)
            events += [(t, v, engine.global_samples) for t, v in moe_monitor_events(engine.module)]
            for m in self.monitors:
                m.write_events(events)
        # Timings, comm and memory reports follow steps_per_print, or every step when it is unset.
        if engine.global_steps % (self.every or 1) == 0:
            self._print_reports(engine, {t.rsplit("/", 1)[-1]: v for t, v, _ in events})
        self._losses, self._tokens = [], 0

    def close(self) -> None:
        """Flush and close the monitors; log the comm totals when the comms logger is on."""
        for m in self.monitors:
            m.close()
        self.monitors = []
        if self.comms and self.rank == 0:
            logger.info("communication totals:\n%s", self.comm_report(comm.STATS.snapshot()))

    # -- pieces ---------------------------------------------------------------------------------------
    def comm_report(self, snapshot: dict) -> str:
        cl = self.config.comms_logger
        kinds = None if cl.prof_all else list(cl.prof_ops)
        return format_comm_report(snapshot, kinds)

    def _profiling_now(self, engine) -> bool:
        # Under tensor parallelism every rank profiles: the model's totals are an all-reduce over tp.
        here = self.rank == 0 or _tp_size(engine) > 1
        return self.profile and here and engine.global_steps == self.config.flops_profiler.profile_step

    def _finish_profile(self, engine) -> None:
        if self.profiler is None:
            return
        fp = self.config.flops_profiler
        if self.rank != 0:  # a tp rank: take part in the model totals' all-reduce, print nothing
            self.profiler.model_totals()
            self.profiler.end_profile()
            self.profiler, self.profile = None, False
            return
        text = format_profile(
            self.profiler,
            module_depth=fp.module_depth,
            top_modules=fp.top_modules,
            detailed=fp.detailed,
            peak_flops=current_device_peak(),
            step=self._step_at_start,
            batch_size=engine.train_micro_batch_size_per_gpu(),
            recompute_fwd_factor=fp.recompute_fwd_factor,
        )
        if fp.output_file:
            Path(fp.output_file).write_text(text + "\n")
        else:
            print(text)
        self.profiler.end_profile()
        self.profiler, self.profile = None, False

    def _step_events(self, engine) -> list[tuple[str, float, int]]:
        now = self._clock()
        elapsed = now - (self._last_time or now)
        self._last_time = now
        x = engine.global_samples
        ev = [("Train/Samples/lr", engine.get_lr()[0], x), ("Train/Samples/loss_scale", engine.loss_scale, x)]
        if self._losses:
            ev.insert(0, ("Train/Samples/train_loss", sum(self._losses) / len(self._losses), x))
        if engine.get_global_grad_norm() is not None:
            ev.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), x))
        if elapsed > 0:
            ev.append(("Train/Samples/samples_per_sec", engine.train_batch_size() / elapsed, x))
            if self._tokens:
                # every rank sees its own micro-batches; the global count is dp_world_size times that
                ev.append(("Train/Samples/tokens_per_sec", self._tokens * engine.dp_world_size / elapsed, x))
        return ev

    def _memory_events(self, engine) -> list[tuple[str, float, int]]:
        mine = engine.accelerator.memory_allocated()
        per_rank = comm.all_gather_object(mine) if engine.dp_world_size > 1 else [mine]
        return [(f"Train/Samples/memory_MiB_rank{r}", b / MIB, engine.global_samples) for r, b in enumerate(per_rank)]

    def _print_reports(self, engine, values: dict[str, float]) -> None:
        if self.every and self.rank == 0:
            logger.info(self._progress_line(engine, values))
        if self.timing and self.rank == 0:
            ms = self.timers.breakdown(self._steps_since_print)
            now = comm.STATS.snapshot()
            delta = diff_snapshots(now, self._comm_mark)
            ms["comm"] = 1e3 * sum(d["seconds"] for d in delta.values()) / self._steps_since_print
            logger.info(format_breakdown(ms, engine.global_steps))
        if self.comms:
            now = comm.STATS.snapshot()
            if self.rank == 0 or self.config.comms_logger.verbose:
                logger.info(
                    "rank %d communication, steps %d-%d:\n%s",
                    self.rank,
                    engine.global_steps - self._steps_since_print + 1,
                    engine.global_steps,
                    self.comm_report(diff_snapshots(now, self._comm_mark)),
                )
        if self.config.memory_breakdown and self.rank == 0:
            phases = self.memory_phases.report() if self.memory_phases is not None else "-"
            logger.info(
                "memory: allocated %.1f MiB; peak by phase: %s; model states %s",
                engine.accelerator.memory_allocated() / MIB,
                phases,
                engine.memory_breakdown(),
            )
        self.timers.reset()
        self._comm_mark = comm.STATS.snapshot()
        self._steps_since_print = 0

    def _progress_line(self, engine, v: dict[str, float]) -> str:
        """DeepSpeed's `steps_per_print` line, `[Rank 0] step=N, skipped=S, lr=[...], mom=[...]`, then
        the numbers zerospeed adds in the same `key=value` form."""
        groups = engine.optimizer.param_groups
        mom = [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in groups]  # DeepSpeed's get_mom
        parts = [
            f"[Rank {self.rank}] step={engine.global_steps}",
            f"skipped={engine.skipped_steps}",
            f"lr={engine.get_lr()}",
            f"mom={mom}",
            f"samples={engine.global_samples}",
        ]
        if "train_loss" in v:
            parts.append(f"loss={v['train_loss']:.4f}")
        if "grad_norm" in v:
            parts.append(f"grad_norm={v['grad_norm']:.4f}")
        parts.append(f"loss_scale={v['loss_scale']:g}")
        if "samples_per_sec" in v:
            parts.append(f"samples/sec={v['samples_per_sec']:.1f}")
        if "tokens_per_sec" in v:
            parts.append(f"tokens/sec={v['tokens_per_sec']:.0f}")
        mem = [f"{b:.0f}" for k, b in sorted(v.items()) if k.startswith("memory_MiB_rank")]
        parts.append(f"mem_MiB={'/'.join(mem) if mem else f'{engine.accelerator.memory_allocated() / MIB:.0f}'}")
        return ", ".join(parts)
