"""Remaining sections: ``activation_checkpointing``, ``elasticity``, ``autotuning``, ``compile``."""

from __future__ import annotations

from pydantic import Field

from zerospeed.config.schema.base import (
    Bool,
    Dict,
    IntList,
    NonNegInt,
    Num,
    OptBool,
    OptDict,
    OptPosInt,
    OptStr,
    PosInt,
    Str,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
)


class ActivationCheckpointingConfig(StrictModel):
    """``activation_checkpointing``: DeepSpeed's activation checkpointing options."""

    partition_activations: Bool = ds_field(False, "Partition checkpointed activations across model-parallel ranks.")
    cpu_checkpointing: Bool = ds_field(False, "Offload checkpointed activations to the CPU.")
    contiguous_memory_optimization: Bool = ds_field(False, "Copy partitioned activations into one buffer.")
    number_checkpoints: OptPosInt = ds_field(None, "Checkpoint count, to size the contiguous buffer.")
    synchronize_checkpoint_boundary: Bool = ds_field(False, "Synchronise the device at each checkpoint.")
    profile: Bool = ds_field(False, "Log forward/backward time of each checkpointed function.")


class ElasticityConfig(StrictModel):
    """``elasticity``: pick a global batch size that works across a range of GPU counts.

    Enabled, it owns the batch sizes: ``zerospeed.elasticity`` checks the block (Note [elastic block
    checks] there) and derives train_batch_size, the micro batch and the accumulation steps at the
    current data-parallel world size (docs/elasticity.md).
    """

    enabled: Bool = ds_field(False, "Enable elastic training (the block then sets the batch sizes).")
    max_train_batch_size: PosInt = ds_field(2000, "Largest acceptable global batch size (required when enabled).")
    micro_batch_sizes: IntList = ds_field([2, 4, 6], "Acceptable micro-batch sizes (required when enabled).")
    min_gpus: PosInt = ds_field(1, "Fewest GPUs to plan for.")
    max_gpus: PosInt = ds_field(10000, "Most GPUs to plan for.")
    min_time: NonNegInt = ds_field(0, "Minutes to run before the scheduler may rescale (0: unknown).")
    prefer_larger_batch: Bool = ds_field(True, "Among equally elastic batch sizes, take the largest.")
    ignore_non_elastic_batch_info: Bool = ds_field(False, "Ignore (not reject) batch keys outside this block.")
    version: Num = ds_field(0.2, "Version of the elasticity algorithm: 0.1 or 0.2.")
    model_parallel_size: PosInt = ds_field(1, "Model-parallel degree (version 0.2 only).")
    num_gpus_per_node: PosInt = ds_field(1, "GPUs per node (version 0.2 only).")


class AutotuningModelInfo(StrictModel):
    """``autotuning.model_info``."""

    profile: Bool = ds_field(False, "Profile the model to fill this in.")
    num_params: OptPosInt = ds_field(None, "Parameter count.")
    hidden_size: OptPosInt = ds_field(None, "Hidden size.")
    num_layers: OptPosInt = ds_field(None, "Layer count.")


class AutotuningConfig(StrictModel):
    """``autotuning``: the autotuner run by ``zerospeed --autotuning tune|run`` (zerospeed/autotuning).

    Inside a training run the block is ignored, as DeepSpeed ignores it without ``--autotuning``; the
    autotuner's trials read ``start_profile_step`` / ``end_profile_step`` from it.
    """

    enabled: Bool = ds_field(False, "Enable the autotuner.")
    fast: Bool = ds_field(
        True,
        "Only tune ZeRO stage, micro-batch size (and offload when listed); false also "
        "tunes other list-valued zero_optimization keys.",
    )
    results_dir: Str = ds_field("autotuning_results", "Directory of experiment results.")
    exps_dir: Str = ds_field("autotuning_exps", "Directory of experiment descriptions.")
    overwrite: Bool = ds_field(True, "Re-run experiments whose results exist (false: reuse them).")
    start_profile_step: PosInt = ds_field(3, "Step at which profiling starts.")
    end_profile_step: PosInt = ds_field(5, "Step at which profiling ends (and the trial exits).")
    metric: choice_type("latency", "throughput", "flops") = ds_field("throughput", "Ranking metric.")
    metric_path: OptStr = ds_field(None, "File the metric is written to (the autotuner sets it per trial).")
    tuner_type: choice_type("gridsearch", "random", "model_based") = ds_field("gridsearch", "Search order.")
    tuner_early_stopping: PosInt = ds_field(5, "Experiments beyond the best before stopping (gridsearch, random).")
    tuner_num_trials: PosInt = ds_field(50, "Most experiments to run.")
    arg_mappings: OptDict = ds_field(None, "Map of config keys to script arguments.")
    max_train_batch_size: OptPosInt = ds_field(None, "Largest global batch size to try.")
    min_train_batch_size: PosInt = ds_field(1, "Smallest global batch size to try.")
    max_train_micro_batch_size_per_gpu: PosInt = ds_field(1024, "Largest micro-batch to try.")
    min_train_micro_batch_size_per_gpu: PosInt = ds_field(1, "Smallest micro-batch to try.")
    num_tuning_micro_batch_sizes: PosInt = ds_field(3, "Micro-batch sizes explored.")
    mp_size: PosInt = ds_field(1, "Model-parallel degree.")
    model_info_path: OptStr = ds_field(None, "File with model information.")
    model_info: AutotuningModelInfo = ds_section(AutotuningModelInfo, "Model information.")


CompilePass = choice_type("z1", "z3", "autosp", "autotp")


class CompileConfig(StrictModel):
    """``compile``: DeepCompile and the older torch.compile options (both key sets parse)."""

    deepcompile: Bool = ds_field(False, "Enable DeepCompile.")
    autoep_non_moe: Bool = ds_field(False, "Compile parents of AutoEP layers, keeping AutoEP eager.")
    free_activation: Bool = ds_field(False, "Eagerly free large activations.")
    free_activation_threshold: NonNegInt = ds_field(10 * 1024 * 1024, "Bytes above which activations are freed.")
    offload_activation: Bool = ds_field(False, "Offload saved activations to pinned host memory.")
    offload_activation_pin_memory: Bool = ds_field(True, "Pin the host buffers of activation offload.")
    offload_opt_states: Bool = ds_field(False, "Offload optimizer states during forward/backward.")
    double_buffer: Bool = ds_field(True, "Double-buffer DeepCompile transfers.")
    symmetric_memory: Bool = ds_field(False, "Use symmetric memory.")
    debug_log: Bool = ds_field(False, "Dump graphs.")
    offload_parameters: Bool = ds_field(False, "Offload parameters.")
    sync_before_reduce: Bool = ds_field(False, "Synchronise before reductions.")
    sync_after_reduce: Bool = ds_field(False, "Synchronise after reductions.")
    sync_before_allgather: Bool = ds_field(False, "Synchronise before all-gathers.")
    sync_after_allgather: Bool = ds_field(False, "Synchronise after all-gathers.")
    keep_int_input_tensors: Bool = ds_field(True, "Keep real values of int inputs.")
    keep_all_input_tensors: Bool = ds_field(False, "Keep real values of all inputs.")
    passes: list[CompilePass] | None = ds_field(None, "Compiler passes to compose.")
    enabled: Bool = ds_field(False, "torch.compile the model (older key set).")
    backend: Str = ds_field("inductor", "torch.compile backend (older key set).")
    kwargs: Dict = Field(default_factory=dict, description="Extra torch.compile kwargs (older key set). Default {}.")
    fullgraph: Bool = ds_field(False, "torch.compile fullgraph (older key set).")
    dynamic: OptBool = ds_field(None, "torch.compile dynamic (older key set).")
    mode: OptStr = ds_field(None, "torch.compile mode (older key set).")
    options: OptDict = ds_field(None, "torch.compile options (older key set).")
    disable: Bool = ds_field(False, "torch.compile disable (older key set).")


__all__ = [
    "ActivationCheckpointingConfig",
    "ElasticityConfig",
    "AutotuningConfig",
    "AutotuningModelInfo",
    "CompileConfig",
]
