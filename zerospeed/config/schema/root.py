"""``ZeroSpeedConfig``: the whole DeepSpeed JSON config, top level.

Field names are DeepSpeed's JSON keys. Sections DeepSpeed treats as "absent means off" are
``None`` by default (``optimizer``, ``scheduler``, ``sparse_attention``, ...); the others default
to their all-default model so engine code can read ``cfg.fp16.enabled`` without checks.
"""

from __future__ import annotations

import pydantic

from zerospeed.config.schema.base import (
    DTYPE_SYNONYMS,
    Bool,
    NonNegNum,
    OptDict,
    OptDtype,
    OptPosInt,
    OptStr,
    PosInt,
    PosNum,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
)
from zerospeed.config.schema.checkpoint import CheckpointConfig, NebulaConfig
from zerospeed.config.schema.compression import CompressionConfig
from zerospeed.config.schema.misc import (
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CompileConfig,
    ElasticityConfig,
)
from zerospeed.config.schema.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from zerospeed.config.schema.offload import AioConfig
from zerospeed.config.schema.optim import OptimizerConfig, SchedulerConfig
from zerospeed.config.schema.parallel import (
    ExpertParallelConfig,
    HybridEngineConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from zerospeed.config.schema.precision import (
    AmpConfig,
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    TorchAutocastConfig,
)
from zerospeed.config.schema.techniques import (
    CurriculumLegacyConfig,
    DataEfficiencyConfig,
    EigenvalueConfig,
    ProgressiveLayerDropConfig,
    QuantizeTrainingConfig,
    SparseAttentionConfig,
    WeightQuantizationConfig,
)
from zerospeed.config.schema.zero import ZeroConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class _BatchAndOptim(StrictModel):
    """Batch sizes, optimizer, scheduler and gradient handling (top-level keys)."""

    train_batch_size: OptPosInt = ds_field(
        None, "Global batch: micro batch x accumulation steps x data-parallel ranks."
    )
    train_micro_batch_size_per_gpu: OptPosInt = ds_field(None, "Samples per rank per forward/backward.")
    gradient_accumulation_steps: OptPosInt = ds_field(None, "Micro-steps accumulated per optimizer step.")
    managed_gradient_accumulation: Bool = ds_field(
        True, "Engine tracks accumulation boundaries (false: the caller steps at boundaries)."
    )
    optimizer: OptimizerConfig | None = ds_field(None, "Optimizer built by the engine; null = none.")
    scheduler: SchedulerConfig | None = ds_field(None, "LR scheduler built by the engine; null = none.")
    zero_allow_untested_optimizer: Bool = ds_field(False, "Allow ZeRO with a client optimizer.")
    zero_force_ds_cpu_optimizer: Bool = ds_field(True, "Require DeepSpeed's CPU optimizer with offload.")
    gradient_clipping: NonNegNum = ds_field(
        1.0, "Clip the global gradient norm to this; 0 = off (DeepSpeed 0.19.8's default is 1.0)."
    )
    prescale_gradients: Bool = ds_field(False, "Scale gradients before the all-reduce, not after.")
    gradient_predivide_factor: PosNum = ds_field(1.0, "Divide gradients by this before the all-reduce.")
    gradient_allreduce_op: choice_type("mean", "sum") = ds_field(
        "mean", "Data-parallel gradient reduction: mean (average) or sum."
    )
    communication_data_type: OptDtype = ds_field(
        None, "Dtype of gradient communication (fp32/fp16/bf16); null follows the precision mode."
    )
    seq_parallel_communication_data_type: choice_type("fp32", "fp16", "bf16", synonyms=DTYPE_SYNONYMS) = ds_field(
        "fp32", "Dtype of sequence-parallel gradient communication."
    )
    sparse_gradients: Bool = ds_field(False, "Reduce nn.Embedding gradients as sparse tensors.")
    disable_allgather: Bool = ds_field(False, "Disable the all-gather of updated parameters.")
    graph_harvesting: Bool = ds_field(False, "Capture short kernel sequences as graphs.")


class _Precision(StrictModel):
    """Precision-related top-level sections."""

    fp16: Fp16Config = ds_section(Fp16Config, "fp16 mixed precision and loss scaling.")
    bf16: Bf16Config = ds_section(Bf16Config, "bf16 mixed precision.")
    amp: AmpConfig = ds_section(AmpConfig, "NVIDIA apex AMP.")
    torch_autocast: TorchAutocastConfig = ds_section(TorchAutocastConfig, "torch.autocast.")
    data_types: DataTypesConfig = ds_section(DataTypesConfig, "Accumulation/parameter/buffer dtypes.")


class _Memory(StrictModel):
    """ZeRO, offload I/O, activation checkpointing and parallelism sections."""

    zero_optimization: ZeroConfig = ds_section(ZeroConfig, "ZeRO memory optimisations.")
    aio: AioConfig = ds_section(AioConfig, "Asynchronous I/O for NVMe offload.")
    activation_checkpointing: ActivationCheckpointingConfig = ds_section(
        ActivationCheckpointingConfig, "Activation checkpointing."
    )
    pipeline: PipelineConfig = ds_section(PipelineConfig, "Pipeline parallelism.")
    tensor_parallel: TensorParallelConfig = ds_section(TensorParallelConfig, "AutoTP tensor parallelism.")
    expert_parallel: ExpertParallelConfig = ds_section(ExpertParallelConfig, "AutoEP expert parallelism.")
    sequence_parallel_size: PosInt = ds_field(1, "Ulysses sequence-parallel degree.")
    use_data_before_expert_parallelism: Bool = ds_field(False, "Order data before expert parallel groups.")
    hybrid_engine: HybridEngineConfig = ds_section(HybridEngineConfig, "Train/generate hybrid engine.")
    compile: CompileConfig = ds_section(CompileConfig, "DeepCompile / torch.compile.")


class _Observability(StrictModel):
    """Logging, monitoring and profiling sections."""

    steps_per_print: OptPosInt = ds_field(None, "Print a progress report every N steps; null (or inf) = never.")
    wall_clock_breakdown: Bool = ds_field(False, "Time forward/backward/step phases.")
    memory_breakdown: Bool = ds_field(False, "Report memory usage at steps.")
    dump_state: Bool = ds_field(False, "Print the engine state after initialisation.")
    log_level: OptStr = ds_field(None, "DeepSpeed logger level, e.g. info.")
    disable_python_gc: Bool = ds_field(False, "Disable Python's cyclic GC while the engine lives.")

    @pydantic.field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_as_infinity(cls, value):
        # transformers' Trainer writes float("inf") to silence DeepSpeed's report; DeepSpeed takes it
        return None if isinstance(value, float) and value == float("inf") else value

    tensorboard: TensorBoardConfig = ds_section(TensorBoardConfig, "TensorBoard monitor.")
    wandb: WandbConfig = ds_section(WandbConfig, "WandB monitor.")
    csv_monitor: CsvMonitorConfig = ds_section(CsvMonitorConfig, "CSV monitor.")
    comet: CometConfig = ds_section(CometConfig, "Comet monitor.")
    comms_logger: CommsLoggerConfig = ds_section(CommsLoggerConfig, "Communication logger.")
    flops_profiler: FlopsProfilerConfig = ds_section(FlopsProfilerConfig, "Flops profiler.")
    timers: TimersConfig = ds_section(TimersConfig, "Engine timers.")
    autotuning: AutotuningConfig = ds_section(AutotuningConfig, "Autotuner.")


class _CheckpointAndData(StrictModel):
    """Checkpointing, data loading and training-technique sections."""

    checkpoint: CheckpointConfig = ds_section(CheckpointConfig, "Checkpoint options.")
    nebula: NebulaConfig = ds_section(NebulaConfig, "Nebula checkpointing.")
    datastates_ckpt: OptDict = ds_field(
        None, "Present: asynchronous checkpoint saves; host_cache_size (GB) bounds the host snapshot."
    )
    casync_ckpt: OptDict = ds_field(None, "Present: asynchronous checkpoint saves.")
    async_load: Bool = ds_field(False, "Read and check this rank's checkpoint files on parallel threads.")
    dataloader_drop_last: Bool = ds_field(False, "Drop the last incomplete batch in deepspeed_io.")
    vocabulary_size: OptPosInt = ds_field(None, "Vocabulary size (only checked for alignment).")
    elasticity: ElasticityConfig = ds_section(ElasticityConfig, "Elastic training.")
    sparse_attention: SparseAttentionConfig | None = ds_field(None, "Sparse attention; null = not used.")
    curriculum_learning: CurriculumLegacyConfig = ds_section(CurriculumLegacyConfig, "Legacy curriculum.")
    data_efficiency: DataEfficiencyConfig = ds_section(DataEfficiencyConfig, "Data efficiency library.")
    progressive_layer_drop: ProgressiveLayerDropConfig = ds_section(
        ProgressiveLayerDropConfig, "Progressive layer drop."
    )
    eigenvalue: EigenvalueConfig = ds_section(EigenvalueConfig, "Eigenvalue computation.")
    quantize_training: QuantizeTrainingConfig = ds_section(QuantizeTrainingConfig, "MoQ quantization.")
    compression_training: CompressionConfig | None = ds_field(None, "Compression library (docs/compression.md).")
    weight_quantization: WeightQuantizationConfig | None = ds_field(None, "Weight quantization.")


class ZeroSpeedConfig(_BatchAndOptim, _Precision, _Memory, _Observability, _CheckpointAndData):
    """The typed DeepSpeed config. Build it with ``zerospeed.config.parse_config``.

    After ``parse_config`` the three batch fields always hold integers.
    """

    @property
    def fp16_enabled(self) -> bool:
        """True when fp16 mixed precision is on."""
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        """True when bf16 mixed precision is on."""
        return self.bf16.enabled

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return self.zero_optimization.stage

    @property
    def untested_optimizers_allowed(self) -> bool:
        """A client optimizer outside ZeRO's tested list is accepted: always without ZeRO (stage 0),
        with it only under `zero_allow_untested_optimizer` (DeepSpeed's rule)."""
        return self.zero_optimization.stage == 0 or self.zero_allow_untested_optimizer

    # -- read like DeepSpeed's config dict: DeepSpeed's `engine.config` is the dict it was given, and
    # libraries read it so (transformers: `engine.config.get("zero_optimization", {}).get("stage")`).
    # Here the values are the resolved ones ("auto" filled in, defaults present), under DeepSpeed's keys.
    def as_dict(self) -> dict:
        """The config as a plain dict under DeepSpeed's key names, with resolved values."""
        return self.model_dump(by_alias=True, mode="json")

    def get(self, key: str, default=None):
        return self.as_dict().get(key, default)

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def keys(self):
        return self.as_dict().keys()

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on with ``loss_scale`` 0, i.e. the loss scale adapts to overflows."""
        return self.fp16.enabled and self.fp16.loss_scale == 0


__all__ = ["ZeroSpeedConfig", "BATCH_KEYS"]
