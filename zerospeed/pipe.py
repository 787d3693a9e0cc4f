"""DeepSpeed's `deepspeed.pipe` names: `from zerospeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec`."""
from zerospeed.comm.topology import RankGrid as PipeDataParallelTopology  # noqa: F401  (pp x dp grid)
from zerospeed.parallel.pipeline import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineEngine", "PipelineModule", "TiedLayerSpec"]
