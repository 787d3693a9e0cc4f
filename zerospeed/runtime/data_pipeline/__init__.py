"""DeepSpeed's `deepspeed.runtime.data_pipeline`: the legacy curriculum-learning scheduler."""
from zerospeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
