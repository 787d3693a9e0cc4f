"""The flops profiler: counts FLOPs/MACs of a forward pass per module, and times each module.

Counting uses a `TorchFunctionMode` (every torch function call passes through it while profiling;
nothing is patched) with the rules in `zerospeed.profiling.flops`. Only top-level calls are seen:
the mode is off while a counted function runs, so `F.gelu`'s own internals are not counted twice.
Forward pre/post hooks keep a stack of the modules that are running; each op is credited to every
module on the stack, so a module's numbers include its children's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from zerospeed.accelerator import get_accelerator
from zerospeed.profiling.flops import count
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
    def __init__(self, profiler: "FlopsProfiler"):
        super().__init__()
        self.profiler = profiler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counts = count(getattr(func, "__name__", ""), args, kwargs, out)
        if counts is not None:
            self.profiler._credit(*counts)
        return out


class FlopsProfiler:
    """Profile `model`'s forward passes between `start_profile()` and `stop_profile()`."""

    def __init__(self, model: torch.nn.Module, ignore_modules: tuple[type, ...] = ()):
        self.model = model
        self.ignore_modules = tuple(ignore_modules)
        self.stats: dict[int, ModuleStats] = {}
        self._stack: list[ModuleStats] = []
        self._hooks: list = []
        self._mode: _CountingMode | None = None
        self.total_flops = self.total_macs = 0
        self._started_at = 0.0
        self.duration = 0.0

    # -- lifecycle --------------------------------------------------------------------------------
    def start_profile(self) -> None:
        """Reset counters, attach hooks and begin counting."""
        self.end_profile()
        self.stats = {id(m): ModuleStats(name or "(model)", type(m).__name__, name.count(".") + bool(name),
                                         sum(full_numel(p) for p in m.parameters()))
                      for name, m in self.model.named_modules() if not isinstance(m, self.ignore_modules)}
        for m in self.model.modules():
            if id(m) in self.stats:
                self._hooks.append(m.register_forward_pre_hook(self._enter))
                self._hooks.append(m.register_forward_hook(self._leave))
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

    def end_profile(self) -> None:
        """Stop and forget everything."""
        self.stop_profile()
        self.stats, self._stack = {}, []
        self.total_flops = self.total_macs = 0

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

    def module_stats(self) -> list[ModuleStats]:
        """Every profiled module in `named_modules` order."""
        return list(self.stats.values())

    # -- hooks --------------------------------------------------------------------------------------
    def _credit(self, flops: int, macs: int) -> None:
        self.total_flops += flops
        self.total_macs += macs
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
