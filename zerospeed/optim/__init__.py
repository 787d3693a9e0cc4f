"""Optimizers (LAMB, Lion, factory for DeepSpeed's optimizer names) and DeepSpeed's LR schedulers."""

from zerospeed.optim.factory import ZERO_TESTED_OPTIMIZERS, build_optimizer, is_zero_tested_optimizer
from zerospeed.optim.lamb import Lamb
from zerospeed.optim.lion import Lion
from zerospeed.optim.scheduler_factory import DEEPSPEED_SCHEDULERS, build_lr_scheduler
from zerospeed.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "DEEPSPEED_SCHEDULERS",
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZERO_TESTED_OPTIMIZERS",
    "build_lr_scheduler",
    "build_optimizer",
    "is_zero_tested_optimizer",
]
