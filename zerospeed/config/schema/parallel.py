"""Model parallelism: ``pipeline``, ``tensor_parallel`` (AutoTP), ``expert_parallel`` (AutoEP), ``hybrid_engine``.

Sequence parallelism has no section of its own in DeepSpeed: it is the top-level integer
``sequence_parallel_size`` (see ``root.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from zerospeed.config.schema.base import (
    DTYPE_SYNONYMS,
    Bool,
    JsonValue,
    NonNegInt,
    Num,
    OptBool,
    OptInt,
    OptIntList,
    OptPosInt,
    OptStr,
    OptStrList,
    PosInt,
    Str,
    StrictModel,
    StrList,
    choice_type,
    ds_field,
    ds_section,
    fail,
)


def _auto_or(kind: str):
    """A field that is the literal ``"auto"`` or a positive int / finite number."""

    def check(value: Any) -> Any:
        if value == "auto":
            return value
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "int" and numeric and value >= 1 and float(value).is_integer():
            return int(value)
        if kind == "num" and numeric and value == value and abs(value) != float("inf"):
            return float(value)
        label = "a positive integer" if kind == "int" else "a number"
        raise fail(f'"auto" or {label}', value)

    return Annotated[Any, BeforeValidator(check)]


class PipelineConfig(StrictModel):
    """``pipeline``: pipeline-parallel engine settings (used with a PipelineModule)."""

    stages: _auto_or("int") = ds_field("auto", 'Number of pipeline stages; "auto" takes it from the module.')
    partition: Str = ds_field("best", "Layer partition method: best, parameters, uniform or type:<regex>.")
    seed_layers: Bool = ds_field(False, "Seed each layer's initialisation with its index.")
    activation_checkpoint_interval: NonNegInt = ds_field(
        0, "Checkpoint activations every N layers of a stage; 0 keeps the module's own setting."
    )
    use_reentrant: OptBool = ds_field(
        None, "Re-entrant activation checkpointing in the pipeline (null = true); false = torch's non-re-entrant."
    )
    pipe_partitioned: Bool = ds_field(True, "Partition activations sent between stages across TP ranks.")
    grad_partitioned: Bool = ds_field(True, "Partition gradients sent between stages across TP ranks.")


class TpInnerConfig(StrictModel):
    """``tensor_parallel.tp``: inference-style tensor-parallel group settings."""

    tp_size: PosInt = ds_field(1, "Devices the model is split across.")
    tp_grain_size: PosInt = ds_field(64, "Granularity of MLP/lm_head splits.")


class TpLayerSpec(StrictModel):
    """One rule of ``tensor_parallel.partition_config.layer_specs``."""

    patterns: StrList = ds_field([], "Regexes matching parameter names this rule applies to.")
    partition_type: choice_type("row", "column", "skip") = ds_field("column", "row, column or skip.")
    shape: OptIntList = ds_field(None, "Sub-parameter shape of fused weights, e.g. [2, -1].")
    partition_dim: OptInt = ds_field(None, "Dimension split when shape is given.")
    model_types: OptStrList = ds_field(None, "Only apply to these model.config.model_type values.")


class TpPartitionConfig(StrictModel):
    """``tensor_parallel.partition_config``: custom AutoTP partition rules."""

    use_default_specs: Bool = ds_field(True, "Merge layer_specs with the preset's rules.")
    layer_specs: list[TpLayerSpec] = ds_field([], "Ordered partition rules.")


class TensorParallelConfig(StrictModel):
    """``tensor_parallel``: AutoTP training tensor parallelism."""

    autotp_size: NonNegInt = ds_field(0, "Tensor-parallel degree; 0 disables AutoTP.")
    tp_overlap_comm: Bool = ds_field(False, "Overlap TP all-reduce with computation.")
    vocab_parallel_lm_head: Bool = ds_field(False, "Keep an untied lm_head vocabulary-sharded.")
    preset_model: OptStr = ds_field(None, "Built-in partition preset (llama, bloom, qwen2, ...).")
    partition_config: TpPartitionConfig | None = ds_field(None, "Custom partition rules.")
    dtype: choice_type("fp32", "fp16", "bf16", synonyms=DTYPE_SYNONYMS) = ds_field(
        "fp16", "Model dtype used by the AutoTP parser."
    )
    keep_module_on_host: Bool = ds_field(False, "Keep loaded checkpoint tensors on the host.")
    kernel_inject: Bool = ds_field(False, "Inject DeepSpeed inference kernels (replace_with_kernel_inject).")
    tp: TpInnerConfig = ds_section(TpInnerConfig, "Tensor-parallel group settings.")


class ExpertParallelConfig(StrictModel):
    """``expert_parallel``: AutoEP expert parallelism for MoE models."""

    enabled: Bool = ds_field(False, "Enable AutoEP.")
    autoep_size: PosInt = ds_field(1, "Expert-parallel degree.")
    expert_tensor_parallel_size: PosInt = ds_field(1, "Expert tensor parallelism (only 1 is accepted).")
    validate_folding_routing: Bool = ds_field(False, "Validate routing under folded parallelism.")
    async_split_plan: Bool = ds_field(False, "Overlap the split-metadata copy with token packing.")
    preset_model: OptStr = ds_field(None, "MoE detection preset (mixtral, qwen3_moe, deepseek_v3, ...).")
    moe_layer_pattern: OptStr = ds_field(None, "Regex matching MoE module names.")
    router_pattern: OptStr = ds_field(None, "Child attribute name of the router.")
    expert_pattern: OptStr = ds_field(None, "Child attribute name of the experts.")
    use_grouped_mm: Bool = ds_field(True, "Use grouped GEMM for expert computation.")
    disable_triton_grouped_mm: Bool = ds_field(False, "Never use the Triton grouped GEMM.")
    route_norm: OptBool = ds_field(None, "Renormalise top-k router scores; null = detect.")
    route_scale: Num = ds_field(1.0, "Scale applied to router scores.")
    score_func: choice_type("auto", "softmax", "sigmoid") = ds_field("auto", "Router scoring function.")
    score_apply: choice_type("auto", "pre", "post") = ds_field("auto", "Apply scores before or after experts.")
    combine_impl: choice_type("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm") = ds_field(
        "auto", "How expert outputs are combined."
    )
    comm_backend: choice_type("comm", "deepep") = ds_field("comm", "All-to-all backend.")
    comm_num_sm: PosInt = ds_field(12, "SMs given to the DeepEP collective.")
    comm_qp_margin: NonNegInt = ds_field(4, "DeepEP queue-pair margin.")
    comm_max_tokens_per_rank: NonNegInt = ds_field(0, "Largest token count one rank routes (DeepEP).")
    top_k: _auto_or("int") = ds_field("auto", 'Experts per token; "auto" reads model.config.')
    routed_scaling_factor: _auto_or("num") = ds_field("auto", "Scale of routed expert outputs.")
    num_expert_groups: OptPosInt = ds_field(None, "Expert groups for group-limited routing.")
    num_limited_groups: OptPosInt = ds_field(None, "Groups selected from in group-limited routing.")
    load_balance_coeff: JsonValue = ds_field(None, "Reserved; only null is accepted by DeepSpeed.")
    expert_w1: OptStr = ds_field(None, "Name of the gate (or fused gate+up) expert weight.")
    expert_w2: OptStr = ds_field(None, "Name of the down-projection expert weight.")
    expert_w3: OptStr = ds_field(None, "Name of the up-projection expert weight; null = fused.")
    num_experts_attr: OptStr = ds_field(None, "model.config attribute holding the expert count.")
    top_k_attr: OptStr = ds_field(None, "model.config attribute holding top-k.")
    has_shared_experts: OptBool = ds_field(None, "Whether MoE layers have shared experts.")
    shared_experts_pattern: OptStr = ds_field(None, "Child attribute name of the shared experts.")
    shared_experts_gate_pattern: OptStr = ds_field(None, "Child attribute name of the shared-expert gate.")


class HybridEngineConfig(StrictModel):
    """``hybrid_engine``: switch one model between training and inference kernels (RLHF)."""

    enabled: Bool = ds_field(False, "Enable the hybrid engine.")
    max_out_tokens: PosInt = ds_field(512, "Maximum generated tokens.")
    inference_tp_size: PosInt = ds_field(1, "Tensor-parallel degree for generation.")
    release_inference_cache: Bool = ds_field(False, "Free the inference cache after generation.")
    pin_parameters: Bool = ds_field(True, "Pin gathered parameters during generation.")
    tp_gather_partition_size: PosInt = ds_field(8, "Layers gathered at a time for TP generation.")
    enable_cuda_graph: Bool = ds_field(False, "Capture generation into CUDA graphs.")
