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

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _unstage(optimizer, args, kwargs) -> None:
    optimizer._staged.clear()


def _store_16bit_params(optimizer, args, kwargs) -> None:
    """Round the fp32 results of the step back into their 16-bit parameters (Note [fp32 moments for 16-bit
    parameters])."""
    with torch.no_grad():
        for p, p32 in optimizer._staged:
            p.copy_(p32)
    optimizer._staged.clear()


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
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        # hooks, not a step() override: torch wraps each class's step with the hook runner once, so an
        # override calling Adam's (already wrapped) step would run every step hook twice
        self.register_step_pre_hook(_unstage)
        self.register_step_post_hook(_store_16bit_params)

    # Note [fp32 moments for 16-bit parameters]: DeepSpeed's host kernel reads an fp16 / bf16 parameter
    # and its gradient into fp32, updates, and rounds the parameter back; with fp32_optimizer_states
    # (the default) its moments are fp32 tensors, otherwise the parameter's dtype. Here a 16-bit
    # parameter's step runs on fp32 copies of the parameter and gradient against fp32 moments (torch's
    # own Adam arithmetic), and the result is copied back into the parameter by a step post-hook.

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        first, first_max = len(params_with_grad), len(max_exp_avg_sqs)
        has_complex = super()._init_group(
            group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        if not self.fp32_optimizer_states:
            return has_complex
        for n, i in enumerate(range(first, len(params_with_grad))):
            p = params_with_grad[i]
            if p.dtype not in _LOW_PRECISION:
                continue
            state = self.state[p]
            for key in _MOMENTS:  # fresh zeros on the first step, or moments loaded in 16 bits
                if key in state and state[key].dtype != torch.float32:
                    state[key] = state[key].float()
            exp_avgs[i], exp_avg_sqs[i] = state["exp_avg"], state["exp_avg_sq"]
            if group["amsgrad"]:
                max_exp_avg_sqs[first_max + n] = state["max_exp_avg_sq"]
            p32 = p.detach().float()
            params_with_grad[i], grads[i] = p32, grads[i].float()
            self._staged.append((p, p32))
        return has_complex

    def load_state_dict(self, state_dict) -> None:
        # torch casts a loaded moment to its parameter's dtype; fp32 moments of a 16-bit parameter stay fp32
        super().load_state_dict(state_dict)
        if not self.fp32_optimizer_states:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, saved_ids):
            saved = state_dict["state"].get(i, {})
            if p.dtype in _LOW_PRECISION:
                for key in _MOMENTS:
                    if key in saved:
                        self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
