"""DeepSpeed's `deepspeed.pipe` names: `from zerospeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec`."""
from zerospeed.parallel.pipeline import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
from zerospeed.parallel.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                  ProcessTopology)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]
