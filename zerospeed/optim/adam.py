"""DeepSpeed's `deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam`, as torch's Adam.

Note [no compiled Adam]: DeepSpeed's versions are a CUDA kernel (FusedAdam) and an AVX host kernel
(DeepSpeedCPUAdam). torch's own Adam does the same arithmetic with its foreach / fused
implementations, so both names are torch.optim.Adam subclasses with DeepSpeed's arguments and
defaults: `adam_w_mode` / `adamw_mode` = decoupled weight decay (AdamW), the default; weight_decay 0.
With ZeRO offload the engine steps the flat fp32 shards with torch's fused CPU Adam whichever Adam
class was given (optim/sub_group_step.py).
"""

from __future__ import annotations

import torch

from zerospeed.optim._kwargs import refuse_no_bias_correction


class FusedAdam(torch.optim.Adam):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        refuse_no_bias_correction("FusedAdam", bias_correction)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=bool(adam_w_mode),
        )
        self.adam_w_mode = bool(adam_w_mode)


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        refuse_no_bias_correction("DeepSpeedCPUAdam", bias_correction)
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=bool(adamw_mode),
        )
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
