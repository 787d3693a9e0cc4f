"""The one place the shim adjusts another library: accelerate's process state on a CPU-only machine.

Note [accelerate on a CPU-only machine]: accelerate 1.15 sets DeepSpeed up only on accelerators it
knows (CUDA, XPU, NPU, HPU, ...). On a CPU-only machine `PartialState._prepare_backend` finds no
backend, so a DeepSpeed job gets `num_processes = 1` and `process_index = 0` on every rank: no
data sharding, a train_batch_size that disagrees with the real world size, every rank writing as
rank 0. (With `use_cpu=True` accelerate skips DeepSpeed altogether.) DeepSpeed itself runs on
CPUs (gloo), and so does zerospeed, so in exactly that case — DeepSpeed requested
(ACCELERATE_USE_DEEPSPEED), launched as a distributed job (LOCAL_RANK), not `use_cpu`, and
accelerate found no device backend — the state is formed as accelerate's multi-CPU one (gloo);
accelerate then switches it to DeepSpeed as it does on GPUs. Nothing changes on a machine with a
GPU, or for a job that does not use DeepSpeed.

The adjustment is installed before `accelerate.state` runs (a post-import hook set up at interpreter
start by the shim's .pth file, or when `deepspeed` is imported first), so no script changes.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "accelerate.state"


def _wants_cpu_deepspeed(cpu: bool) -> bool:
    from zerospeed.compat.alias import deepspeed_is_shim  # a real DeepSpeed first on the path is left alone

    if cpu or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    if int(os.environ.get("LOCAL_RANK", -1)) == -1 or not deepspeed_is_shim():
        return False
    from zerospeed.accelerator import get_accelerator
    return get_accelerator().communication_backend_name() == "gloo"


def patch_state_module(state) -> None:
    """Wrap `state.PartialState._prepare_backend` (Note [accelerate on a CPU-only machine])."""
    cls = state.PartialState
    original = cls._prepare_backend
    if getattr(original, "__zerospeed__", False):
        return

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and kind == state.DistributedType.NO and _wants_cpu_deepspeed(cpu):
            return "gloo", state.DistributedType.MULTI_CPU
        return found, kind

    _prepare_backend.__zerospeed__ = True
    _prepare_backend.__wrapped__ = original
    cls._prepare_backend = _prepare_backend


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        patch_state_module(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self.loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install_hook() -> None:
    """Adjust accelerate.state now if it is loaded, else when it is imported."""
    if TARGET in sys.modules:
        patch_state_module(sys.modules[TARGET])
    elif not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())
