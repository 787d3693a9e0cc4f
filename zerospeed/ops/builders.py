"""DeepSpeed's op builders (`deepspeed.ops.op_builder`) and op reports (`deepspeed.ops.__compatible_ops__`,
`deepspeed.git_version_info.installed_ops`), for a library with nothing to build.

Each DeepSpeed op (a C++/CUDA extension compiled at install time or on first use) is, in zerospeed, a
PyTorch module that is already importable: the CPU and fused optimizers are `zerospeed.optim`'s, async I/O is
`zerospeed.offload.aio`, the quantizer is `zerospeed.precision.quantize`, and so on (`OP_HOMES`). So every op
here is compatible and installed, and a builder's `load()` returns the op's home module. Code that calls an
op's C entry points directly (`CPUAdamBuilder().load().adam_update(...)`) does not find them there: that
part of DeepSpeed has no counterpart (docs/compat.md).
"""

from __future__ import annotations

import types

import torch

from zerospeed.deepspeed_paths import resolve

OP_HOMES: dict[str, str] = {
    "async_io": "zerospeed.offload.aio",
    "cpu_adagrad": "zerospeed.optim.adagrad",
    "cpu_adam": "zerospeed.optim.adam",
    "cpu_lion": "zerospeed.optim.lion",
    "fused_adam": "zerospeed.optim.adam",
    "fused_lamb": "zerospeed.optim.lamb",
    "fused_lion": "zerospeed.optim.lion",
    "quantizer": "zerospeed.precision.quantize",
    "sparse_attn": "zerospeed.ops.sparse_attention",
    "evoformer_attn": "zerospeed.ops.evoformer",
    "pin_memory": "zerospeed.accelerator",
    "deepspeed_shm_comm": "zerospeed.comm",
    "deepspeed_ccl_comm": "zerospeed.comm",
}
"""DeepSpeed's op name -> the zerospeed module that does the op's work."""

ALL_OPS = {name: f"deepspeed.ops.{name}" for name in OP_HOMES}
compatible_ops = dict.fromkeys(OP_HOMES, True)
installed_ops = dict.fromkeys(OP_HOMES, True)


class OpBuilder:
    """An op that needs no build: always compatible, and loading it gives its zerospeed module."""

    NAME = ""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return ALL_OPS[self.name]

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> types.ModuleType:
        """The module that implements the op (nothing is compiled)."""
        return resolve(OP_HOMES[self.name])

    def jit_load(self, verbose: bool = True) -> types.ModuleType:
        return self.load(verbose)

    def builder(self):
        raise NotImplementedError(f"{self.name}: zerospeed builds no extension; load() gives its PyTorch module")


def _builder(class_name: str, op: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": op, "__doc__": f"DeepSpeed's `{op}` op: {OP_HOMES[op]}."})


AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer")
SparseAttnBuilder = _builder("SparseAttnBuilder", "sparse_attn")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm")
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm")


def get_default_compute_capabilities() -> str:
    """No kernels are compiled for any device: the capabilities list is empty."""
    return ""


torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": True,
    "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
    "nccl_version": "0.0",
    "hip_version": "0.0",
}
"""`git_version_info.torch_info`: the torch zerospeed runs on (nothing was compiled against another one)."""
