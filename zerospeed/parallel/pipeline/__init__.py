"""Pipeline parallelism: PipelineModule, schedules, simulator, engine, per-layer checkpoints.

`PipelineEngine` and `PipelineError` live with the engines (zerospeed.runtime.pipeline, a layer above);
this package serves them by name through the alias table (zerospeed/deepspeed_paths.py `NAMES`).
"""

from zerospeed.deepspeed_paths import package_getattr
from zerospeed.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.parallel.pipeline.partition import partition, partition_balanced, partition_by_type, partition_uniform
from zerospeed.parallel.pipeline.simulate import ScheduleError, simulate

__all__ = [
    "LayerSpec",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "ScheduleError",
    "TiedLayerSpec",
    "partition",
    "partition_balanced",
    "partition_by_type",
    "partition_uniform",
    "simulate",
]

__getattr__ = package_getattr(__name__)
