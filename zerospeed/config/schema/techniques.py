"""Training techniques: sparse attention, curriculum / data efficiency, progressive layer drop,
eigenvalue, MoQ (``quantize_training``) and ``weight_quantization`` (the compression library's
``compression_training`` has its own module, ``compression.py``).

Blocks whose contents DeepSpeed passes through to a sub-library unchecked (curriculum metrics) are
typed as free-form objects one level down; the level that DeepSpeed itself reads is strict.
Random-LTD's block is typed in full (zerospeed builds it: ``data/random_ltd``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from zerospeed.config.schema.base import (
    ERROR_KIND,
    Bool,
    Dict,
    Int,
    IntList,
    NonNegInt,
    OptInt,
    OptIntList,
    OptNonNegInt,
    OptPosInt,
    OptStr,
    PosInt,
    PosNum,
    Str,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
    float_type,
)


class SparseAttentionConfig(StrictModel):
    """``sparse_attention``: block-sparse self-attention layouts; the model builds its layers from it
    with ``zerospeed.ops.sparse_attention.build_sparsity_config`` (the engine applies nothing itself,
    as in DeepSpeed)."""

    mode: choice_type("dense", "fixed", "variable", "bigbird", "bslongformer") = ds_field(
        "fixed", "Sparsity structure."
    )
    block: PosInt = ds_field(16, "Block size of the blocked sparse matrices.")
    different_layout_per_head: Bool = ds_field(False, "Give each head its own layout.")
    num_local_blocks: PosInt = ds_field(4, "Blocks per local window (fixed mode).")
    num_global_blocks: PosInt = ds_field(1, "Global representative blocks per window.")
    attention: choice_type("bidirectional", "unidirectional") = ds_field("bidirectional", "Attention type.")
    horizontal_global_attention: Bool = ds_field(False, "Global blocks also attend horizontally.")
    num_different_global_patterns: PosInt = ds_field(1, "Different global layouts across heads.")
    num_random_blocks: NonNegInt = ds_field(0, "Random blocks per block row.")
    local_window_blocks: IntList = ds_field([4], "Blocks in each local window (variable mode).")
    global_block_indices: IntList = ds_field([0], "Indices of global blocks.")
    global_block_end_indices: OptIntList = ds_field(None, "End indices of global windows.")
    num_sliding_window_blocks: PosInt = ds_field(3, "Blocks in the sliding window (bigbird, bslongformer).")


class CurriculumLegacyConfig(StrictModel):
    """Top-level ``curriculum_learning``: the legacy sequence-length curriculum."""

    enabled: Bool = ds_field(False, "Enable curriculum learning.")
    curriculum_type: OptStr = ds_field(None, "Difficulty metric, e.g. seqlen.")
    min_difficulty: OptInt = ds_field(None, "Starting difficulty.")
    max_difficulty: OptInt = ds_field(None, "Final difficulty.")
    schedule_type: OptStr = ds_field(None, "fixed_linear, fixed_root, fixed_discrete or custom.")
    schedule_config: Dict = Field(default_factory=dict, description="Schedule parameters. Default {}.")


class CurriculumSamplingConfig(StrictModel):
    """``data_efficiency.data_sampling.curriculum_learning``."""

    enabled: Bool = ds_field(False, "Enable curriculum data sampling.")
    data_cluster_path: OptStr = ds_field(None, "Directory for the difficulty clusters.")
    curriculum_metrics: Dict = Field(
        default_factory=dict, description="Per-metric settings keyed by metric name. Default {}."
    )


class DataSamplingConfig(StrictModel):
    """``data_efficiency.data_sampling``."""

    enabled: Bool = ds_field(False, "Enable data sampling techniques.")
    num_epochs: PosInt = ds_field(1000, "Epochs of the dataset iterated at most.")
    num_workers: NonNegInt = ds_field(0, "Data loader workers.")
    pin_memory: Bool = ds_field(False, "Pin the curriculum loader's batches in host memory.")
    curriculum_learning: CurriculumSamplingConfig = ds_section(CurriculumSamplingConfig, "Curriculum sampling.")
    dynamic_batching: Dict = Field(
        default_factory=dict,
        description="Variable batch size and LR settings (DeepSpeed's separate helper). Default {}.",
    )


def _needed(meaning: str) -> Any:
    """A key DeepSpeed reads without a default once random-LTD is on (a KeyError there)."""
    return Field(
        None, description=f"{meaning} Default null; set it when random_ltd.enabled is true (DeepSpeed has no default)."
    )


class RandomLTDLinearConfig(StrictModel):
    """``data_efficiency.data_routing.random_ltd.random_ltd_schedule.schedule_config``: the fixed_linear ramp."""

    require_steps: OptPosInt = _needed("Steps from min_value to max_value.")
    seq_per_step: OptPosInt = _needed("Reserved lengths are rounded down to a multiple of this.")


class RandomLTDScheduleConfig(StrictModel):
    """``data_efficiency.data_routing.random_ltd.random_ltd_schedule``: the reserved (kept) sequence length."""

    min_value: OptPosInt = _needed("Tokens each random-LTD layer keeps at step 0.")
    max_value: OptPosInt = _needed("Tokens kept at the end of the ramp (usually the full sequence length).")
    schedule_type: choice_type("fixed_linear", nullable=True) = _needed("The ramp; DeepSpeed has only fixed_linear.")
    schedule_config: RandomLTDLinearConfig = ds_section(RandomLTDLinearConfig, "The ramp's parameters.")


class LayerTokenLRScheduleConfig(StrictModel):
    """``data_efficiency.data_routing.random_ltd.layer_token_lr_schedule`` (DeepSpeed raises
    NotImplementedError when it is enabled)."""

    enabled: Bool = ds_field(False, "Schedule the learning rate by consumed layer-tokens.")
    total_layer_tokens: OptPosInt = ds_field(None, "Layer-tokens of the whole run.")
    warmup_type: OptStr = ds_field(None, "Warm-up shape.")
    warmup_layer_tokens: OptNonNegInt = ds_field(None, "Layer-tokens of the warm-up.")


_RANDOM_LTD_NEEDS = (
    "total_layer_num",
    "random_ltd_layer_num",
    "random_ltd_layer_id",
    "model_type",
    "hidden_state_order",
    "random_ltd_schedule.min_value",
    "random_ltd_schedule.max_value",
    "random_ltd_schedule.schedule_type",
    "random_ltd_schedule.schedule_config.require_steps",
    "random_ltd_schedule.schedule_config.seq_per_step",
)


class RandomLTDConfig(StrictModel):
    """``data_efficiency.data_routing.random_ltd``: random layerwise token dropping (arXiv 2211.11586),
    switched on by its own ``enabled`` as in DeepSpeed."""

    enabled: Bool = ds_field(False, "Enable random-LTD.")
    total_layer_num: OptPosInt = _needed("Layers of the model (for the consumed layer-token count).")
    random_ltd_layer_num: OptPosInt = _needed("Layers that drop tokens (the length of random_ltd_layer_id).")
    random_ltd_layer_id: OptIntList = _needed("Indices of the layers that drop tokens, as in their module names.")
    model_mask_name: OptStr = ds_field(None, "Keyword under which the layers get the attention mask (null: none).")
    model_type: choice_type("decoder", "encoder", nullable=True) = _needed(
        "decoder: the kept tokens get the mask's leading block; encoder: the mask's rows and columns of the kept "
        "tokens."
    )
    hidden_state_order: choice_type("batch_seq_dim", "seq_batch_dim", nullable=True) = _needed(
        "Layout of the hidden states: [batch, seq, hidden] or [seq, batch, hidden]."
    )
    micro_batch_size: OptPosInt = ds_field(None, "Set by the engine to train_micro_batch_size_per_gpu.")
    global_batch_size: OptPosInt = ds_field(None, "Set by the engine to train_batch_size.")
    random_ltd_schedule: RandomLTDScheduleConfig = ds_section(RandomLTDScheduleConfig, "Reserved-length ramp.")
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = ds_section(
        LayerTokenLRScheduleConfig, "Layer-token learning-rate schedule."
    )

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        missing = [key for key in _RANDOM_LTD_NEEDS if _lookup(self, key) is None]
        if missing:
            raise PydanticCustomError(
                ERROR_KIND,
                "enabled is true but {keys} {verb} not set (DeepSpeed has no defaults for them)",
                {"keys": ", ".join(missing), "verb": "is" if len(missing) == 1 else "are"},
            )
        schedule, ids = self.random_ltd_schedule, self.random_ltd_layer_id
        problems = [
            f"random_ltd_layer_num ({self.random_ltd_layer_num}) must equal the length of "
            f"random_ltd_layer_id ({len(ids)})"
            if len(ids) != self.random_ltd_layer_num
            else "",
            f"random_ltd_layer_num ({self.random_ltd_layer_num}) must be at most total_layer_num "
            f"({self.total_layer_num})"
            if self.random_ltd_layer_num > self.total_layer_num
            else "",
            "random_ltd_layer_id must list distinct non-negative layer indices"
            if len(set(ids)) != len(ids) or min(ids) < 0
            else "",
            f"random_ltd_schedule.min_value ({schedule.min_value}) must be at most max_value ({schedule.max_value})"
            if schedule.min_value > schedule.max_value
            else "",
        ]
        if any(problems):
            raise PydanticCustomError(ERROR_KIND, "{text}", {"text": "; ".join(p for p in problems if p)})
        return self


def _lookup(model, dotted: str):
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


class DataRoutingConfig(StrictModel):
    """``data_efficiency.data_routing``."""

    enabled: Bool = ds_field(False, "Enable data routing techniques (DeepSpeed reads random_ltd.enabled only).")
    random_ltd: RandomLTDConfig = ds_section(RandomLTDConfig, "Random-LTD.")


class DataEfficiencyConfig(StrictModel):
    """``data_efficiency``: the data efficiency library (curriculum data sampling; random-LTD)."""

    enabled: Bool = ds_field(False, "Enable data efficiency.")
    seed: Int = ds_field(1234, "Random seed for data sampling.")
    data_sampling: DataSamplingConfig = ds_section(DataSamplingConfig, "Data sampling.")
    data_routing: DataRoutingConfig = ds_section(DataRoutingConfig, "Data routing.")


class ProgressiveLayerDropConfig(StrictModel):
    """``progressive_layer_drop``: stochastic layer dropping with a schedule."""

    enabled: Bool = ds_field(False, "Enable progressive layer drop.")
    theta: float_type(0.0, 1.0) = ds_field(1.0, "Final keep probability.")
    gamma: PosNum = ds_field(0.001, "Decay rate of the keep probability.")


class EigenvalueConfig(StrictModel):
    """``eigenvalue``: Hessian eigenvalue estimation (used by MoQ)."""

    enabled: Bool = ds_field(False, "Compute eigenvalues.")
    verbose: Bool = ds_field(False, "Print eigenvalues.")
    max_iter: PosInt = ds_field(100, "Power-iteration steps.")
    tol: PosNum = ds_field(0.01, "Convergence tolerance.")
    stability: PosNum = ds_field(1e-6, "Numerical stability epsilon.")
    gas_boundary_resolution: PosInt = ds_field(1, "Compute every N accumulation boundaries.")
    layer_name: Str = ds_field("bert.encoder.layer", "Module path of the layers.")
    layer_num: NonNegInt = ds_field(0, "Number of layers.")


class QuantizeBitsConfig(StrictModel):
    """``quantize_training.quantize_bits``."""

    start_bits: PosInt = ds_field(16, "Bits at the start of training.")
    target_bits: PosInt = ds_field(8, "Bits at the end of the schedule.")


class QuantizeScheduleConfig(StrictModel):
    """``quantize_training.quantize_schedule``."""

    quantize_period: PosInt = ds_field(1000, "Steps between precision reductions.")
    schedule_offset: NonNegInt = ds_field(1000, "Steps before quantization starts.")


class Fp16MixedQuantizeConfig(StrictModel):
    """``quantize_training.fp16_mixed_quantize``."""

    enabled: Bool = ds_field(False, "Mix fp16 and quantized weights during the transition.")
    quantize_change_ratio: PosNum = ds_field(0.001, "Per-step change of the mix ratio.")


class QuantizeAlgoConfig(StrictModel):
    """``quantize_training.quantize_algo``."""

    q_type: choice_type("symmetric", "asymmetric", synonyms={0: "symmetric", 1: "asymmetric"}) = ds_field(
        "symmetric", "Quantization type."
    )
    rounding: choice_type("nearest", "stochastic", synonyms={0: "nearest", 1: "stochastic"}) = ds_field(
        "nearest", "Rounding mode."
    )


class QuantizeTrainingConfig(StrictModel):
    """``quantize_training``: Mixture-of-Quantization (MoQ)."""

    enabled: Bool = ds_field(False, "Enable MoQ.")
    quantize_bits: QuantizeBitsConfig = ds_section(QuantizeBitsConfig, "Bit schedule.")
    quantize_schedule: QuantizeScheduleConfig = ds_section(QuantizeScheduleConfig, "Step schedule.")
    quantize_groups: PosInt = ds_field(1, "Quantization groups per tensor.")
    fp16_mixed_quantize: Fp16MixedQuantizeConfig = ds_section(Fp16MixedQuantizeConfig, "fp16 mixing.")
    quantize_verbose: Bool = ds_field(False, "Log quantization steps.")
    quantizer_kernel: Bool = ds_field(False, "Use the CUDA quantizer kernel.")
    quantize_algo: QuantizeAlgoConfig = ds_section(QuantizeAlgoConfig, "Algorithm.")
    eigenvalue: EigenvalueConfig = ds_section(EigenvalueConfig, "Eigenvalue-based MoQ.")


class WeightQuantizationConfig(StrictModel):
    """Top-level ``weight_quantization``: ZeRO-Inference style weight quantization."""

    enabled: Bool = ds_field(True, "Quantize weights.")
    num_bits: PosInt = ds_field(8, "Bits per weight.")
    q_type: choice_type("symmetric", "asymmetric") = ds_field("symmetric", "Quantization type.")
    q_groups: PosInt = ds_field(1, "Quantization groups.")
    quantized_initialization: Dict = Field(default_factory=dict, description="Quantize at init. Default {}.")
    post_init_quant: Dict = Field(default_factory=dict, description="Quantize after init. Default {}.")
