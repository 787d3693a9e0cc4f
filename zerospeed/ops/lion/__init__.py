"""DeepSpeed's `deepspeed.ops.lion`: `FusedLion` and `DeepSpeedCPULion`, as zerospeed's Lion with
DeepSpeed's defaults (lr 1e-3, betas (0.9, 0.999)); Note [no compiled Adam] in zerospeed/ops/adam."""
from __future__ import annotations

from zerospeed.optim.lion import Lion


class FusedLion(Lion):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states


__all__ = ["DeepSpeedCPULion", "FusedLion"]
