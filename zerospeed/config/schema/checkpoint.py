"""Checkpointing: ``checkpoint`` (tags, universal, writer), ``nebula`` and ``datastates_ckpt``."""

from __future__ import annotations

from pydantic import Field

from zerospeed.config.schema.base import (
    Bool,
    OptStr,
    PosInt,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
)


class ParallelWriteConfig(StrictModel):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = ds_field(
        False, "Share each pipeline stage's layer files among its data-parallel ranks instead of its rank 0."
    )


class CheckpointWriterConfig(StrictModel):
    """``checkpoint.writer``: DeepSpeed's fast checkpoint writer, mapped onto zerospeed's (docs/checkpoints.md)."""

    type: choice_type("MOCK", "PYTHON", "FAST") = ds_field(
        "FAST", "Writer implementation: FAST and PYTHON write real files; MOCK (writes nothing) is refused."
    )
    io_buffer_size: PosInt = ds_field(64 * 1024**2, "File buffer each checkpoint file is written through, bytes.")
    io_buffer_double: Bool = ds_field(True, "Double-buffer the I/O; no effect (the background writer overlaps).")
    show_statistics: Bool = ds_field(False, "Log bytes, seconds, GB/s and the training stall of each save.")
    data_parallel: choice_type("REPLICA", "SOCKET", "MACHINE", nullable=True) = ds_field(
        None, "Unit that writes in parallel; no effect (every rank writes only its own shard)."
    )
    decoupled: Bool = ds_field(False, "Asynchronous saves: save_checkpoint returns after a host snapshot.")
    io_multiplier: PosInt = ds_field(1, "I/O parallelism multiplier; no effect.")


class CheckpointConfig(StrictModel):
    """``checkpoint``: checkpoint tag validation and loading options."""

    tag_validation: choice_type("WARN", "IGNORE", "FAIL") = ds_field(
        "WARN", "Check that checkpoint tags agree across ranks: Warn, Ignore or Fail."
    )
    load_universal: Bool = ds_field(False, "Load a universal (resharding) checkpoint.")
    use_node_local_storage: Bool = ds_field(
        False,
        "Every node writes and reads its own copy (local rank 0 writes manifest and latest): no shared filesystem.",
    )
    parallel_write: ParallelWriteConfig = ds_section(ParallelWriteConfig, "Parallel write settings.")
    checkpoint_serialization: Bool = ds_field(True, "Use torch.save serialization.")
    writer: CheckpointWriterConfig | None = ds_field(None, "Fast checkpoint writer; null uses torch.save.")
    deepspeed_layout: Bool = Field(
        False,
        description=(
            "zerospeed only (DeepSpeed has no such key): at ZeRO 1-3, write each rank file in DeepSpeed 0.19.8's "
            "layout as well as zerospeed's (the same tensors, stored once; at ZeRO 3 plus DeepSpeed's per-rank "
            "model states), so DeepSpeed's load_checkpoint reads the tag as saved at the same stage and dp; costs "
            "an all-gather of the optimizer state per save. ZeRO 0 (fp32): the optimizer state goes into the model "
            "states as DeepSpeed's `optimizer`, zerospeed's entries with it (no gather). Default false."
        ),
    )


class NebulaConfig(StrictModel):
    """``nebula``: Azure Nebula asynchronous checkpointing."""

    enabled: Bool = ds_field(False, "Enable Nebula.")
    persistent_storage_path: OptStr = ds_field(None, "Where Nebula persists checkpoints.")
    persistent_time_interval: PosInt = ds_field(100, "Seconds between persistence runs.")
    num_of_version_in_retention: PosInt = ds_field(2, "Checkpoint versions kept in memory.")
    enable_nebula_load: Bool = ds_field(True, "Load through Nebula.")
    nebula_load_path: OptStr = ds_field(None, "Checkpoint folder to resume from.")
