"""``zero_optimization``: ZeRO stages, buckets, stage-3 tuning, offload and ZeRO++ switches."""

from __future__ import annotations

import sys
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from zerospeed.config.schema.base import (
    Bool,
    Fraction,
    Int,
    NonNegInt,
    OptBool,
    OptDict,
    OptNonNegInt,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
    fail,
    list_type,
)
from zerospeed.config.schema.offload import OffloadOptimizerConfig, OffloadParamConfig

ZeroStage = choice_type(0, 1, 2, 3)


def _auto_or_count(value: Any) -> Any:
    # ZenFlow intervals are either the literal "auto" or a positive step count.
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or not float(value).is_integer():
        raise fail('"auto" or a positive integer', value)
    return int(value)


AutoOrCount = Annotated[Any, BeforeValidator(_auto_or_count)]


class ZenFlowConfig(StrictModel):
    """``zero_optimization.zenflow``: ZenFlow selective, stall-free offloaded updates."""

    topk_ratio: Fraction = ds_field(0.1, "Ratio of important gradient columns kept on the GPU.")
    select_strategy: choice_type("auto", "step", "epoch") = ds_field(
        "auto", "How important gradient indices are re-selected: auto, step or epoch."
    )
    select_interval: AutoOrCount = ds_field("auto", 'Re-selection interval: "auto" or a step count.')
    update_interval: AutoOrCount = ds_field("auto", "Interval for applying unimportant gradients.")
    overlap_step: Bool = ds_field(False, "Overlap the CPU optimizer step with forward/backward.")
    offload: Bool = ds_field(False, "Offload selective optimizer states to the CPU.")
    auto_ratio: Fraction = ds_field(0.99, "Threshold the auto strategy uses to pick update_interval.")
    full_warm_up_rounds: NonNegInt = ds_field(0, "Initial rounds in which all gradients are updated.")
    pt_reserved_cores_perc: Fraction = ds_field(0.5, "Fraction of CPU cores reserved for PyTorch threads.")
    steps_per_epoch: OptNonNegInt = ds_field(
        None, 'Optimizer steps per epoch: the "epoch" select strategy\'s interval (DeepSpeed fills it in).'
    )


class LeafModuleConfig(StrictModel):
    """``zero_optimization.leaf_module``: modules ZeRO-3 treats as one unit (no inner hooks)."""

    classes: list_type("str", single_ok=True) = ds_field(
        [
            "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
            "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
            "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        ],
        "Fully qualified module class names treated as leaves.",
    )
    names: list_type("str", single_ok=True) = ds_field([], "Module names treated as leaves.")
    name_suffixes: list_type("str", single_ok=True) = ds_field([], "Module name suffixes treated as leaves.")


class ZeroConfig(StrictModel):
    """``zero_optimization``: ZeRO memory optimisations (stage 0 = plain data parallel)."""

    stage: ZeroStage = ds_field(0, "ZeRO stage: 0 off, 1 optimizer states, 2 +gradients, 3 +parameters.")
    contiguous_gradients: Bool = ds_field(True, "Copy gradients into a contiguous buffer as produced.")
    reduce_scatter: Bool = ds_field(True, "Average gradients with reduce/reduce-scatter instead of all-reduce.")
    reduce_bucket_size: NonNegInt = ds_field(500_000_000, "Elements reduced per bucket.")
    use_multi_rank_bucket_allreduce: Bool = ds_field(True, "Combine ranks' reduce buckets into one all-reduce.")
    allgather_partitions: Bool = ds_field(True, "All-gather updated partitions (else a series of broadcasts).")
    allgather_bucket_size: NonNegInt = ds_field(500_000_000, "Elements all-gathered per bucket.")
    overlap_comm: OptBool = ds_field(None, "Overlap gradient reduction with backward; null means stage == 3.")
    load_from_fp32_weights: Bool = ds_field(True, "Initialise fp32 master weights from the checkpoint's fp32 copy.")
    elastic_checkpoint: Bool = ds_field(False, "Load checkpoints saved at another GPU count (no longer supported).")
    offload_param: OffloadParamConfig | None = ds_field(None, "Parameter offload to CPU/NVMe (stage 3 only).")
    offload_optimizer: OffloadOptimizerConfig | None = ds_field(None, "Optimizer state offload to CPU/NVMe.")
    zenflow: ZenFlowConfig | None = ds_field(None, "ZenFlow settings; null disables ZenFlow.")
    sub_group_size: NonNegInt = ds_field(1_000_000_000, "Tile size (elements) for the optimizer step.")
    stage3_prefetch_bucket_size: NonNegInt = ds_field(50_000_000, "Parameter elements prefetched ahead of use.")
    stage3_param_persistence_threshold: NonNegInt = ds_field(
        100_000, "Parameters smaller than this stay unpartitioned."
    )
    stage3_model_persistence_threshold: NonNegInt = ds_field(
        sys.maxsize, "Upper bound on unpartitioned parameter elements."
    )
    stage3_max_live_parameters: NonNegInt = ds_field(1_000_000_000, "Parameters resident per GPU before release.")
    stage3_max_reuse_distance: NonNegInt = ds_field(
        1_000_000_000, "Do not release a parameter reused within this many parameters."
    )
    stage3_gather_16bit_weights_on_model_save: Bool = ds_field(
        False, "Gather partitioned weights when saving the 16-bit model."
    )
    stage3_module_granularity_threshold: Int = ds_field(0, "Granularity below which modules are fetched whole.")
    stage3_use_all_reduce_for_fetch_params: Bool = ds_field(False, "Fetch stage-3 parameters with all-reduce.")
    stage3_allgather_sequential: Bool = ds_field(False, "All-gather parameters one by one without bucketing.")
    ignore_unused_parameters: Bool = ds_field(True, "Ignore parameters that get no gradient (stage 2).")
    legacy_stage1: Bool = ds_field(False, "Use the old ZeRO stage-1 implementation.")
    round_robin_gradients: Bool = ds_field(False, "Parallelise gradient copies to CPU across ranks (1/2).")
    zero_hpz_partition_size: NonNegInt = ds_field(1, "Ranks in the hpZ secondary partition group (ZeRO++).")
    zero_quantized_weights: Bool = ds_field(False, "Quantize weights for all-gather (ZeRO++).")
    zero_quantized_nontrainable_weights: Bool = ds_field(False, "Store non-trainable weights quantized.")
    zero_quantized_gradients: Bool = ds_field(False, "Quantize gradients for reduction (ZeRO++).")
    zeropp_loco_param: OptDict = ds_field(None, "LoCo-ZeRO++ settings (err_beta, reset_T).")
    mics_shard_size: Int = ds_field(-1, "MiCS shard group size; -1 disables MiCS.")
    mics_hierarchical_params_gather: Bool = ds_field(False, "Hierarchical all-gather for MiCS.")
    memory_efficient_linear: Bool = ds_field(True, "Memory-efficient linear layer for stage 3.")
    pipeline_loading_checkpoint: Bool = ds_field(False, "Force pipeline-mode checkpoint loading (stage 3).")
    override_module_apply: Bool = ds_field(True, "Override nn.Module.apply under stage 3.")
    log_trace_cache_warnings: Bool = ds_field(False, "Log stage-3 trace-cache warnings.")
    enable_sanity_checks: Bool = ds_field(False, "Run internal sanity checks (debugging).")
    compute_grad_norm: Bool = ds_field(True, "Compute and keep the global gradient norm (stages 1/2).")
    parameter_alignment: Bool = ds_field(False, "Pad flat buffers so each parameter is 16-byte aligned.")
    save_muon_momentum_buffer_in_memory: Bool = ds_field(False, "Keep the Muon momentum in memory under NVMe offload.")
    leaf_module: LeafModuleConfig = ds_section(LeafModuleConfig, "ZeRO-3 leaf modules.")

    # DeepSpeed's attribute names for the stage-3 keys (its model names the field `prefetch_bucket_size`
    # and takes `stage3_prefetch_bucket_size` as the alias), so code reading them off the config works.
    prefetch_bucket_size = property(lambda self: self.stage3_prefetch_bucket_size)
    param_persistence_threshold = property(lambda self: self.stage3_param_persistence_threshold)
    model_persistence_threshold = property(lambda self: self.stage3_model_persistence_threshold)
    max_live_parameters = property(lambda self: self.stage3_max_live_parameters)
    max_reuse_distance = property(lambda self: self.stage3_max_reuse_distance)
    gather_16bit_weights_on_model_save = property(lambda self: self.stage3_gather_16bit_weights_on_model_save)
    module_granularity_threshold = property(lambda self: self.stage3_module_granularity_threshold)
    use_all_reduce_for_fetch_params = property(lambda self: self.stage3_use_all_reduce_for_fetch_params)
    allgather_sequential = property(lambda self: self.stage3_allgather_sequential)

    @model_validator(mode="after")
    def _resolve_overlap_comm(self) -> ZeroConfig:
        # DeepSpeed's dynamic default: overlap only under stage 3 unless the user says so.
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        return self
