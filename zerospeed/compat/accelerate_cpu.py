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

The adjustment is applied right after `accelerate.state` runs, by a post-import hook set up at
interpreter start by the shim's .pth file, or when `deepspeed` is imported first (compat/import_hooks.py,
which imports this module only then: Note [post-import hooks by name]), so no script changes.
"""

from __future__ import annotations

import os

from zerospeed.accelerator import get_accelerator
from zerospeed.compat.distribution import deepspeed_is_shim
from zerospeed.compat.import_hooks import install_hook  # noqa: F401 (its former home)

TARGET = "accelerate.state"


def _wants_cpu_deepspeed(cpu: bool) -> bool:
    if cpu or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    if int(os.environ.get("LOCAL_RANK", -1)) == -1 or not deepspeed_is_shim():  # a real DeepSpeed: left alone
        return False
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
