"""Observability: monitors (TensorBoard, W&B, CSV, Comet), comms logger, flops profiler, timers."""

from __future__ import annotations

from zerospeed.config.schema.base import (
    Bool,
    Int,
    NonNegNum,
    OptBool,
    OptStr,
    PosInt,
    Str,
    StrictModel,
    StrList,
    choice_type,
    ds_field,
    ds_section,
)


class TensorBoardConfig(StrictModel):
    """``tensorboard``: write training scalars as TensorBoard events."""

    enabled: Bool = ds_field(False, "Log to TensorBoard.")
    output_path: Str = ds_field("", "Directory for the event files; empty = under the launch directory.")
    job_name: Str = ds_field("DeepSpeedJobName", "Sub-directory name for this job.")


class CsvMonitorConfig(StrictModel):
    """``csv_monitor``: write training scalars to local CSV files."""

    enabled: Bool = ds_field(False, "Log to CSV files.")
    output_path: Str = ds_field("", "Directory for the CSV files; empty = under the launch directory.")
    job_name: Str = ds_field("DeepSpeedJobName", "Sub-directory name for this job.")


class WandbConfig(StrictModel):
    """``wandb``: log training scalars to Weights & Biases."""

    enabled: Bool = ds_field(False, "Log to WandB.")
    group: OptStr = ds_field(None, "WandB group name.")
    team: OptStr = ds_field(None, "WandB team name.")
    project: Str = ds_field("deepspeed", "WandB project name.")


class CometConfig(StrictModel):
    """``comet``: log training scalars to Comet."""

    enabled: Bool = ds_field(False, "Log to Comet.")
    samples_log_interval: PosInt = ds_field(100, "Submit metrics every this many samples.")
    project: OptStr = ds_field(None, "Comet project name.")
    workspace: OptStr = ds_field(None, "Comet workspace name.")
    api_key: OptStr = ds_field(None, "Comet API key (better set through the environment).")
    experiment_name: OptStr = ds_field(None, "Comet experiment name.")
    experiment_key: OptStr = ds_field(None, "Comet experiment key (32-50 alphanumerics).")
    online: OptBool = ds_field(None, "Log online (true) or to an offline experiment (false).")
    mode: choice_type("get_or_create", "create", "get", nullable=True) = ds_field(
        None, "How the experiment is started: get_or_create, create or get."
    )


class CommsLoggerConfig(StrictModel):
    """``comms_logger``: record every collective launched through the comm layer."""

    enabled: Bool = ds_field(False, "Log communication operations.")
    verbose: Bool = ds_field(False, "Print every operation as it happens.")
    prof_all: Bool = ds_field(True, "Profile all operations (else only prof_ops).")
    debug: Bool = ds_field(False, "Append the calling function to each op's log name.")
    prof_ops: StrList = ds_field([], "Operations to profile when prof_all is false.")


class FlopsProfilerConfig(StrictModel):
    """``flops_profiler``: profile flops, latency and parameters of one step."""

    enabled: Bool = ds_field(False, "Run the flops profiler (also enables wall-clock timing).")
    recompute_fwd_factor: NonNegNum = ds_field(0.0, "Extra forward recompute factor (activation checkpointing).")
    profile_step: PosInt = ds_field(1, "Global step at which to profile.")
    module_depth: Int = ds_field(-1, "Module depth to aggregate; -1 = innermost.")
    top_modules: PosInt = ds_field(1, "Number of top modules shown in the aggregate.")
    detailed: Bool = ds_field(True, "Print the detailed per-module profile.")
    output_file: OptStr = ds_field(None, "Write the profile here; null prints to stdout.")


class ThroughputTimerConfig(StrictModel):
    """``timers.throughput``: the samples-per-second timer."""

    enabled: Bool = ds_field(True, "Measure throughput.")
    synchronized: Bool = ds_field(True, "Synchronise the device when taking times.")


class TimersConfig(StrictModel):
    """``timers``: engine timers."""

    throughput: ThroughputTimerConfig = ds_section(ThroughputTimerConfig, "Throughput timer settings.")
