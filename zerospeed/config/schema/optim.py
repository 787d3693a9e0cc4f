"""``optimizer`` and ``scheduler``: a type name plus free-form constructor parameters."""

from __future__ import annotations

from pydantic import Field

from zerospeed.config.schema.base import Bool, Dict, OptStr, StrictModel, ds_field


class OptimizerConfig(StrictModel):
    """``optimizer``: which optimizer the engine builds and its constructor arguments."""

    type: OptStr = ds_field(None, "Optimizer name (Adam, AdamW, Lamb, ... or a torch.optim class).")
    params: Dict = Field(
        default_factory=dict, description="Constructor arguments, e.g. lr, betas. Default {} (none given)."
    )
    legacy_fusion: Bool = ds_field(False, "Use the legacy fused fp16 optimizer wrapper.")


class SchedulerConfig(StrictModel):
    """``scheduler``: which LR scheduler the engine builds and its constructor arguments."""

    type: OptStr = ds_field(None, "Scheduler name (WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest, ...).")
    params: Dict = Field(
        default_factory=dict, description="Constructor arguments, e.g. warmup_num_steps. Default {} (none given)."
    )
