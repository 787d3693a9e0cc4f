"""The precision policy: resolved once from the config, read everywhere else."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype the model computes in, and whether fp32 master weights and a loss scale exist."""

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    """`torch_autocast`: fp32 parameters, the forward under torch.autocast in this dtype."""

    @property
    def mixed(self) -> bool:
        """Low-precision model parameters backed by fp32 master weights."""
        return self.param_dtype != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return torch.float16 in (self.param_dtype, self.autocast_dtype)

    @classmethod
    def from_config(cls, cfg) -> "PrecisionPolicy":
        if cfg.fp16_enabled:
            return cls(param_dtype=torch.float16)
        if cfg.bf16_enabled:
            return cls(param_dtype=torch.bfloat16)
        if cfg.torch_autocast.enabled:
            return cls(autocast_dtype={"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.torch_autocast.dtype])
        return cls()
