"""DeepSpeed's `deepspeed.runtime.zero.offload_config`: the offload device and state-kind enums, and the
offload config sections under DeepSpeed's class names (the typed schema lives in zerospeed/config)."""
from __future__ import annotations

from enum import Enum

from zerospeed.config.schema.offload import OffloadOptimizerConfig, OffloadParamConfig

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors go."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of engine state `engine.offload_states(include=...)` moves (DeepSpeed's names)."""

    optim_states = "optim_states"  # the optimizer's state tensors (Adam's moments)
    hp_params = "hp_params"  # fp32 master weights (this rank's partition)
    lp_params = "lp_params"  # the low-precision weights the model computes with (this rank's)
    lp_grads = "lp_grads"  # the gradient buffers (this rank's partition at stages 2-3)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # reduction staging buffers: freed, never restored
