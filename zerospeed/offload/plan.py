"""Where each kind of ZeRO model state lives: the offload plan, resolved once (the engine's plans
translate the config's `offload_optimizer` / `offload_param` / `aio` sections into it).

ZeRO-Offload moves the fp32 master weights, the optimizer states and the fp32 gradient shard to
host memory, and runs the optimizer step there; ZeRO-Infinity moves masters and optimizer states
(`offload_optimizer.device: nvme`) and/or the parameter shards (`offload_param.device: nvme`) to
swap files. The strategies ask this plan where to allocate, never the config.

Note [offload on a CPU-only machine]: the "device" and the "host" are then the same memory, so CPU
offload changes no tensor's device; what it changes is the step (the fused CPU optimizer over flat
sub-group buffers) and, for 16-bit/fp32 aliasing, nothing else. NVMe offload is real everywhere:
the bytes leave memory for the swap files (tests check the files and the tensor census).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.offload.aio import AioPlan, AsyncIO
from zerospeed.offload.delayed_update import DelayedStepper
from zerospeed.offload.optimizer_swap import NvmeOptimizerSwapper
from zerospeed.offload.param_swap import NvmeParamSwapper
from zerospeed.offload.swap import check_nvme_path
from zerospeed.optim.sub_group_step import InMemoryStepper, OverlappedStepper

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadPlan:
    device: torch.device  # where compute happens
    optimizer: str = "none"  # none | cpu | nvme: masters, optimizer states (and fp32 grad shards)
    param: str = "none"  # none | cpu | nvme: stage-3 parameter shards
    pin: bool = False
    ratio: float = 1.0  # stage 3: fraction of the optimizer (by elements) that is offloaded
    optimizer_nvme: Path | None = None
    param_nvme: Path | None = None
    optimizer_buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    aio: AioPlan | None = None  # the resolved `aio` section (NVMe swaps)
    # Note [overlapped step] (optim/sub_group_step.py): the CPU step on a worker thread, pipelined with
    # the copy back (`offload_optimizer.overlap_step`, zerospeed's own key) ...
    overlap_step: bool = False
    # ... and started during the boundary backward: the step's coefficient is 1 whatever the gradient
    # norm (no clipping, no loss scale, no skipping of non-finite steps)
    early_step: bool = False
    # Note [delayed parameter update] (offload/delayed_update.py): the host step one step late, in the
    # background (`offload_optimizer.delayed_param_update`, zerospeed's own key), after `delayed_warm_up`
    # ordinary steps
    delayed_update: bool = False
    delayed_warm_up: int = 0

    # -- where things go ---------------------------------------------------------------------------
    @property
    def master_device(self) -> torch.device:
        """Masters and optimizer states: the host when offloaded (NVMe swaps through host buffers)."""
        return HOST if self.optimizer != "none" else self.device

    @property
    def masters_apart(self) -> bool:
        """Masters never share the parameters' storage: the delayed update steps them while the model
        computes with the previous values."""
        return self.delayed_update

    @property
    def shard_device(self) -> torch.device:
        return HOST if self.param != "none" else self.device

    def host_copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new host tensor holding `t` (pinned where that speeds up device copies)."""
        out = t.detach().to(HOST, dtype=dtype or t.dtype, copy=True)
        return self.pinned(out)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pinned(torch.zeros(numel, dtype=dtype))

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        return get_accelerator().pin_memory(t) if self.pin else t

    @functools.cached_property
    def io(self):
        """The one asynchronous I/O engine (thread pool) every NVMe swapper of this rank shares."""
        return AsyncIO.from_plan(self.aio) if self.aio is not None else AsyncIO()

    def describe(self) -> dict[str, str]:
        """Human-readable placement of each kind of state (the engine's placement map builds on it)."""
        opt = f"nvme:{self.optimizer_nvme}" if self.optimizer == "nvme" else str(self.master_device)
        par = f"nvme:{self.param_nvme}" if self.param == "nvme" else str(self.shard_device)
        return {
            "master_weights": opt,
            "optimizer_states": opt,
            "gradients": str(self.master_device),
            "parameter_shards": par,
        }


def make_stepper(plan: OffloadPlan | None, masters: list[torch.nn.Parameter], sub_groups: list[list[int]], rank: int):
    """The optimizer stepper for this plan: in memory (overlapped on the host: Note [overlapped step]), or
    through NVMe swap files; or one step late (Note [delayed parameter update])."""
    if plan is not None and plan.optimizer == "cpu" and plan.delayed_update:
        return DelayedStepper(plan.delayed_warm_up)
    if plan is not None and plan.optimizer == "cpu" and plan.overlap_step and plan.ratio == 1.0:
        return OverlappedStepper(sub_groups, copies_back=plan.device != HOST)
    if plan is None or plan.optimizer != "nvme":
        return InMemoryStepper()
    numel = sum(m.numel() for m in masters)
    # fp32 masters + two Adam moments: the usual worst case of an elementwise optimizer
    check_nvme_path(plan.optimizer_nvme, 12 * numel, key="zero_optimization.offload_optimizer.nvme_path")
    return NvmeOptimizerSwapper(
        masters,
        sub_groups,
        directory=plan.optimizer_nvme,
        rank=rank,
        aio=plan.io,
        pipeline_read=plan.pipeline_read,
        pipeline_write=plan.pipeline_write,
        pin=plan.pin,
    )


def make_param_swapper(plan: OffloadPlan | None, fps: list, rank: int, dtype: torch.dtype):
    """Stage 3 with `offload_param.device: nvme`: the swapper that moves the shards of `fps` to disk."""
    if plan is None or plan.param != "nvme":
        return None
    nbytes = sum(fp.shard_numel for fp in fps) * torch.tensor([], dtype=dtype).element_size()
    check_nvme_path(plan.param_nvme, nbytes, key="zero_optimization.offload_param.nvme_path")
    return NvmeParamSwapper(
        fps,
        directory=plan.param_nvme,
        rank=rank,
        aio=plan.io,
        buffer_count=plan.param_buffer_count,
        buffer_size=plan.param_buffer_size,
        dtype=dtype,
        pin=plan.pin,
    )
