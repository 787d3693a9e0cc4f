"""Pipeline parallelism: PipelineModule, schedules, simulator, engine, per-layer checkpoints."""
from zerospeed.runtime.pipeline import PipelineEngine, PipelineError
from zerospeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.parallel.pipeline.partition import (partition, partition_balanced, partition_by_type,
                                                   partition_uniform)
from zerospeed.parallel.pipeline.simulate import ScheduleError, simulate

__all__ = ["LayerSpec", "PipelineEngine", "PipelineError", "PipelineModule", "ScheduleError", "TiedLayerSpec",
           "partition", "partition_balanced", "partition_by_type", "partition_uniform", "simulate"]
