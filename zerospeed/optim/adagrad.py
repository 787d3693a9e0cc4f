"""DeepSpeed's `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, as torch's Adagrad (Note [no compiled Adam]
in zerospeed/ops/adam)."""

from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states


__all__ = ["DeepSpeedCPUAdagrad"]
