"""DeepSpeed's `deepspeed.runtime.pipe.topology` path; see `zerospeed.parallel.pipeline.topology`."""
from zerospeed.parallel.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                  ProcessTopology)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
