"""DeepSpeed's `deepspeed.runtime.data_pipeline`: the legacy curriculum-learning scheduler, and random-LTD in
`data_routing` (the data sampler of `data_sampling` is not built)."""
from zerospeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
