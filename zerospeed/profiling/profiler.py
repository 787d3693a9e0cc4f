"""The flops profiler: counts FLOPs/MACs of a forward pass per module, and times each module.

Counting uses a `TorchFunctionMode` (every torch function call passes through it while profiling;
nothing is patched) with the rules in `zerospeed.profiling.flops`. Only top-level calls are seen:
the mode is off while a counted function runs, so `F.gelu`'s own internals are not counted twice.
Forward pre/post hooks keep a stack of the modules that are running; each op is credited to every
module on the stack, so a module's numbers include its children's.

Under tensor parallelism the counts are this rank's (its local shards: a split layer's matmuls are
1/tp of the model's) and the profiler also keeps the model's totals, each op counted once over the tp
group (`tensor_parallel.ReplicaTracker`): `get_total_flops()` and friends are per rank,
`get_model_flops()` / `get_model_macs()` / `get_model_params()` are the whole model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.parallel.tensor.state import replica_counts
from zerospeed.profiling.flops import count
from zerospeed.profiling.tensor_parallel import ReplicaTracker
from zerospeed.zero import full_numel  # a ZeRO-3 parameter's full size, not its shard


@dataclass
class ModuleStats:
    """One module's inclusive numbers for the profiled forward pass(es)."""

    name: str
    kind: str
    depth: int
    params: int
    flops: int = 0
    macs: int = 0
    latency: float = 0.0
    calls: int = 0
    _started: list[float] = field(default_factory=list, repr=False)


class _CountingMode(TorchFunctionMode):
    def __init__(self, profiler: FlopsProfiler):
        super().__init__()
        self.profiler = profiler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracker = self.profiler._tracker
        replicas = tracker.op_replicas(args, kwargs) if tracker is not None else 1
        out = func(*args, **kwargs)
        if tracker is not None:
            tracker.mark(out, replicas)
        counts = count(getattr(func, "__name__", ""), args, kwargs, out)
        if counts is not None:
            self.profiler._credit(*counts, replicas)
        return out


# `tp_group=None` is the default (world) process group, as everywhere in zerospeed; no group is this.
NO_GROUP = object()


def _engine_tp_group(engine):
    """The tensor-parallel group of a zerospeed engine, or NO_GROUP without tensor parallelism."""
    mesh = getattr(engine, "mesh", None)
    return mesh.group("tp") if mesh is not None and mesh.size("tp") > 1 else NO_GROUP


class FlopsProfiler:
    """Profile `model`'s forward passes between `start_profile()` and `stop_profile()`.

    DeepSpeed's signature (`ds_engine`, `recompute_fwd_factor`) plus `ignore_modules`. Tensor
    parallelism: `tp_group` (default: the engine's tp group; None is the world group) gives exact model
    totals by one all-reduce when they are read — every rank of the group must profile the same forward
    and read them; `tp_size` alone (no communication) assumes every tp rank did the same work.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_engine=None,
        recompute_fwd_factor: float = 0.0,
        ignore_modules: tuple[type, ...] = (),
        *,
        tp_group=NO_GROUP,
        tp_size: int | None = None,
    ):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.ignore_modules = tuple(ignore_modules)
        self.tp_group = tp_group if tp_group is not NO_GROUP else _engine_tp_group(ds_engine)
        group_size = comm.get_world_size(self.tp_group) if self.tp_group is not NO_GROUP else None
        if tp_size is not None and group_size is not None and tp_size != group_size:
            raise ValueError(f"FlopsProfiler: tp_size={tp_size} but the tp_group has {group_size} ranks")
        if tp_size is not None and tp_size < 1:
            raise ValueError(f"FlopsProfiler: tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size or group_size or 1
        self.stats: dict[int, ModuleStats] = {}
        self._stack: list[ModuleStats] = []
        self._hooks: list = []
        self._mode: _CountingMode | None = None
        self._tracker: ReplicaTracker | None = None
        self.total_flops = self.total_macs = 0
        self._unique = [0, 0]  # flops, macs, each op weighted tp / replicas (tensor_parallel.py)
        self._model_totals: tuple[int, int, int] | None = None
        self._started_at = 0.0
        self.duration = 0.0

    # -- lifecycle --------------------------------------------------------------------------------
    def start_profile(self) -> None:
        """Reset counters, attach hooks and begin counting."""
        self.end_profile()
        self.stats = {
            id(m): ModuleStats(
                name or "(model)",
                type(m).__name__,
                name.count(".") + bool(name),
                sum(full_numel(p) for p in m.parameters()),
            )
            for name, m in self.model.named_modules()
            if not isinstance(m, self.ignore_modules)
        }
        for m in self.model.modules():
            if id(m) in self.stats:
                self._hooks.append(m.register_forward_pre_hook(self._enter))
                self._hooks.append(m.register_forward_hook(self._leave))
        if self.tp_size > 1:
            self._tracker = ReplicaTracker(self.model, self.tp_size)
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        get_accelerator().synchronize()
        self._started_at = time.perf_counter()

    def stop_profile(self) -> None:
        """Stop counting (numbers stay readable until the next start or `end_profile`)."""
        if self._mode is not None:
            get_accelerator().synchronize()
            self.duration = time.perf_counter() - self._started_at
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def end_profile(self) -> None:
        """Stop and forget everything."""
        self.stop_profile()
        self.stats, self._stack = {}, []
        self.total_flops = self.total_macs = 0
        self._unique, self._model_totals = [0, 0], None

    @property
    def running(self) -> bool:
        """True between `start_profile()` and `stop_profile()`."""
        return self._mode is not None

    # -- results ----------------------------------------------------------------------------------
    def get_total_flops(self) -> int:
        return self.total_flops

    def get_total_macs(self) -> int:
        return self.total_macs

    def get_total_params(self) -> int:
        return sum({id(p): full_numel(p) for p in self.model.parameters()}.values())

    def get_total_duration(self) -> float:
        return self.duration

    # -- the whole model under tensor parallelism -------------------------------------------------------
    def model_totals(self) -> tuple[int, int, int]:
        """(flops, macs, params) of the whole model: this rank's numbers at tp 1; under tensor parallelism
        the sum over the tp ranks with replicated work and parameters counted once (collective when a
        tp_group is set: every rank of the group must call it; the result is cached)."""
        if self.tp_size == 1:
            return self.get_total_flops(), self.get_total_macs(), self.get_total_params()
        if self._model_totals is None:
            counts = replica_counts(self.model, self.tp_size)
            unique_params = sum(full_numel(p) * (self.tp_size // counts[n]) for n, p in self.model.named_parameters())
            mine = [*self._unique, unique_params]
            if self.tp_group is not NO_GROUP:
                device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
                t = torch.tensor(mine, dtype=torch.int64, device=device)
                comm.all_reduce(t, group=self.tp_group)
                mine = [v // self.tp_size for v in t.tolist()]
            self._model_totals = tuple(mine)
        return self._model_totals

    def get_model_flops(self) -> int:
        """Forward FLOPs of the whole model (sum over tp ranks, replicated work once)."""
        return self.model_totals()[0]

    def get_model_macs(self) -> int:
        return self.model_totals()[1]

    def get_model_params(self) -> int:
        """Parameters of the whole model (sum of the tp shards, replicated ones once)."""
        return self.model_totals()[2]

    def module_stats(self) -> list[ModuleStats]:
        """Every profiled module in `named_modules` order."""
        return list(self.stats.values())

    # -- hooks --------------------------------------------------------------------------------------
    def _credit(self, flops: int, macs: int, replicas: int = 1) -> None:
        self.total_flops += flops
        self.total_macs += macs
        weight = self.tp_size // replicas
        self._unique[0] += flops * weight
        self._unique[1] += macs * weight
        for s in self._stack:
            s.flops += flops
            s.macs += macs

    def _enter(self, module, inputs) -> None:
        s = self.stats[id(module)]
        s._started.append(time.perf_counter())
        self._stack.append(s)

    def _leave(self, module, inputs, output) -> None:
        s = self.stats[id(module)]
        get_accelerator().synchronize()
        s.latency += time.perf_counter() - s._started.pop()
        s.calls += 1
        if self._stack and self._stack[-1] is s:
            self._stack.pop()
