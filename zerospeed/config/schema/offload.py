"""Offload targets for ZeRO (``offload_param``, ``offload_optimizer``) and the ``aio`` NVMe engine."""

from __future__ import annotations

from pydantic import Field

from zerospeed.config.schema.base import (
    Bool,
    Fraction,
    NonNegInt,
    OptStr,
    PosInt,
    StrictModel,
    choice_type,
    ds_field,
)

OffloadDevice = choice_type("none", "cpu", "nvme")


class OffloadParamConfig(StrictModel):
    """``zero_optimization.offload_param``: where ZeRO-3 keeps parameters (stage 3 only)."""

    device: OffloadDevice = ds_field("none", "Memory to offload parameters to: none, cpu or nvme.")
    nvme_path: OptStr = ds_field(None, "Filesystem path of the NVMe device for parameter offload.")
    buffer_count: NonNegInt = ds_field(5, "Buffers in the pool for parameter offload to NVMe.")
    buffer_size: NonNegInt = ds_field(100_000_000, "Size (elements) of each NVMe parameter buffer.")
    max_in_cpu: NonNegInt = ds_field(1_000_000_000, "Parameter elements kept in CPU memory with NVMe offload.")
    pin_memory: Bool = ds_field(False, "Offload to page-locked (pinned) CPU memory.")


class OffloadOptimizerConfig(StrictModel):
    """``zero_optimization.offload_optimizer``: where optimizer state lives and the step runs."""

    device: OffloadDevice = ds_field("none", "Memory to offload optimizer state to: none, cpu or nvme.")
    nvme_path: OptStr = ds_field(None, "Filesystem path of the NVMe device for optimizer state.")
    buffer_count: NonNegInt = ds_field(4, "Buffers in the pool for optimizer-state offload to NVMe.")
    pin_memory: Bool = ds_field(False, "Offload to page-locked (pinned) CPU memory.")
    pipeline_read: Bool = ds_field(False, "Overlap reading the next tile with computing the current one.")
    pipeline_write: Bool = ds_field(False, "Overlap writing the previous tile with computing the current one.")
    fast_init: Bool = ds_field(False, "Fast optimizer initialisation when offloading to NVMe.")
    ratio: Fraction = ds_field(1.0, "Fraction of optimizer states updated on the CPU (stage 3 only).")
    super_offload: Bool = ds_field(False, "High-performance CPU offload for superchips (stage 3 only).")
    convert_grad_on_cpu: Bool = ds_field(True, "Convert gradients on the CPU rather than the GPU.")
    cpuadam_cores_perc: Fraction = ds_field(0.8, "Fraction of CPU cores used by CPU Adam with super_offload.")
    overlap_step: Bool = Field(
        True,
        description=(
            "zerospeed only (DeepSpeed has no such key): with device cpu, step each sub-group on a host worker "
            "thread as soon as its gradient shard is final, overlapping the backward and the copy back; "
            "false = the sequential step (benchmarks, debugging). Results are the same. Default true."
        ),
    )
    delayed_param_update: Bool = Field(
        False,
        description=(
            "zerospeed only (DeepSpeed has no such key): ZeRO-Offload's one-step delayed parameter update, "
            "stages 1-2 with device cpu: step t's host optimizer step runs in the background while step t+1's "
            "forward and backward use the parameters of step t-1 (gradients one update stale: changes the "
            "training numbers). Default false."
        ),
    )
    delayed_param_update_warm_up: NonNegInt = Field(
        0,
        description=(
            "zerospeed only: optimizer steps taken without the delay before delayed_param_update starts. Default 0."
        ),
    )

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived attribute: either direction of NVMe pipelining is on."""
        return self.pipeline_read or self.pipeline_write


AioBackend = choice_type("async_io", "posix", synonyms={"aio": "async_io", "async": "async_io", "deepnvme": "async_io"})


class AioConfig(StrictModel):
    """``aio``: the asynchronous I/O engine used for NVMe offload."""

    io_backend: AioBackend = ds_field("async_io", "I/O backend: async_io (libaio) or posix.")
    block_size: PosInt = ds_field(1_048_576, "I/O block size in bytes.")
    queue_depth: PosInt = ds_field(8, "I/O queue depth.")
    intra_op_parallelism: PosInt = ds_field(1, "Parallelism within each read/write request.")
    thread_count: PosInt = ds_field(1, "Older name of intra_op_parallelism.")
    single_submit: Bool = ds_field(False, "Submit requests one by one instead of as a block.")
    overlap_events: Bool = ds_field(True, "Submit without waiting for earlier requests to complete.")
    use_gds: Bool = ds_field(False, "Use NVIDIA GPUDirect Storage.")
