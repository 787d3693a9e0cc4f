"""Training techniques: sparse attention, curriculum / data efficiency, progressive layer drop,
eigenvalue, MoQ (``quantize_training``) and ``weight_quantization`` (the compression library's
``compression_training`` has its own module, ``compression.py``).

Blocks whose contents DeepSpeed passes through to a sub-library unchecked (curriculum metrics,
random-LTD) are typed as free-form objects one level down; the level that DeepSpeed itself reads
is strict.
"""

from __future__ import annotations

from pydantic import Field

from zerospeed.config.schema.base import (
    Bool, Dict, Int, IntList, NonNegInt, OptInt, OptIntList, OptStr, PosInt, PosNum,
    StrictModel, Str, choice_type, ds_field, ds_section, float_type,
)


class SparseAttentionConfig(StrictModel):
    """``sparse_attention``: block-sparse self-attention layouts; the model builds its layers from it
    with ``zerospeed.ops.sparse_attention.build_sparsity_config`` (the engine applies nothing itself,
    as in DeepSpeed)."""

    mode: choice_type("dense", "fixed", "variable", "bigbird", "bslongformer") = ds_field(
        "fixed", "Sparsity structure.")
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
    curriculum_metrics: Dict = Field(default_factory=dict,
                                     description="Per-metric settings keyed by metric name. Default {}.")


class DataSamplingConfig(StrictModel):
    """``data_efficiency.data_sampling``."""

    enabled: Bool = ds_field(False, "Enable data sampling techniques.")
    num_epochs: PosInt = ds_field(1000, "Epochs of the dataset iterated at most.")
    num_workers: NonNegInt = ds_field(0, "Data loader workers.")
    curriculum_learning: CurriculumSamplingConfig = ds_section(CurriculumSamplingConfig, "Curriculum sampling.")


class DataRoutingConfig(StrictModel):
    """``data_efficiency.data_routing``."""

    enabled: Bool = ds_field(False, "Enable data routing techniques.")
    random_ltd: Dict = Field(default_factory=dict, description="Random-LTD settings. Default {}.")


class DataEfficiencyConfig(StrictModel):
    """``data_efficiency``: the data efficiency library (curriculum sampling, random-LTD)."""

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
        "symmetric", "Quantization type.")
    rounding: choice_type("nearest", "stochastic", synonyms={0: "nearest", 1: "stochastic"}) = ds_field(
        "nearest", "Rounding mode.")


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
