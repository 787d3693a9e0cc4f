"""Checkpointing: ``checkpoint`` (tags, universal, writer), ``nebula`` and ``datastates_ckpt``."""

from __future__ import annotations

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

    pipeline_stage: Bool = ds_field(False, "Parallelise checkpoint writes across pipeline stages.")


class CheckpointWriterConfig(StrictModel):
    """``checkpoint.writer``: the fast checkpoint writer."""

    type: choice_type("MOCK", "PYTHON", "FAST") = ds_field("FAST", "Writer implementation.")
    io_buffer_size: PosInt = ds_field(64 * 1024**2, "I/O buffer size in bytes.")
    io_buffer_double: Bool = ds_field(True, "Double-buffer the I/O.")
    show_statistics: Bool = ds_field(False, "Print write statistics.")
    data_parallel: choice_type("REPLICA", "SOCKET", "MACHINE", nullable=True) = ds_field(
        None, "Unit that writes in parallel: replica, socket or machine."
    )
    decoupled: Bool = ds_field(False, "Write in a decoupled background process.")
    io_multiplier: PosInt = ds_field(1, "I/O parallelism multiplier.")


class CheckpointConfig(StrictModel):
    """``checkpoint``: checkpoint tag validation and loading options."""

    tag_validation: choice_type("WARN", "IGNORE", "FAIL") = ds_field(
        "WARN", "Check that checkpoint tags agree across ranks: Warn, Ignore or Fail."
    )
    load_universal: Bool = ds_field(False, "Load a universal (resharding) checkpoint.")
    use_node_local_storage: Bool = ds_field(False, "Save per local rank so no shared filesystem is needed.")
    parallel_write: ParallelWriteConfig = ds_section(ParallelWriteConfig, "Parallel write settings.")
    checkpoint_serialization: Bool = ds_field(True, "Use torch.save serialization.")
    writer: CheckpointWriterConfig | None = ds_field(None, "Fast checkpoint writer; null uses torch.save.")


class NebulaConfig(StrictModel):
    """``nebula``: Azure Nebula asynchronous checkpointing."""

    enabled: Bool = ds_field(False, "Enable Nebula.")
    persistent_storage_path: OptStr = ds_field(None, "Where Nebula persists checkpoints.")
    persistent_time_interval: PosInt = ds_field(100, "Seconds between persistence runs.")
    num_of_version_in_retention: PosInt = ds_field(2, "Checkpoint versions kept in memory.")
    enable_nebula_load: Bool = ds_field(True, "Load through Nebula.")
    nebula_load_path: OptStr = ds_field(None, "Checkpoint folder to resume from.")
