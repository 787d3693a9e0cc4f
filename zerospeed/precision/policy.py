"""The precision policy: resolved once (the engine's plans translate the config into it), read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed.utils.errors import ConfigError


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype the model computes in, and whether fp32 master weights and a loss scale exist."""

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    """`torch_autocast`: fp32 parameters, the forward under torch.autocast in this dtype."""
    master_dtype: torch.dtype = torch.float32
    """Of the optimizer's master weights, their gradients and its states: bf16 with
    `bf16.bf16_master_weights_and_grads` (Note [bf16 masters])."""

    @property
    def master_bytes(self) -> int:
        """Bytes per element a master copy adds beside the model's own weights (none when it is them)."""
        return 4 if self.mixed and self.master_dtype == torch.float32 else 0

    @property
    def mixed(self) -> bool:
        """Low-precision model parameters backed by fp32 master weights."""
        return self.param_dtype != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return torch.float16 in (self.param_dtype, self.autocast_dtype)

    @classmethod
    def resolve(
        cls,
        *,
        fp16: bool = False,
        bf16: bool = False,
        autocast: str | None = None,
        grad_accum_dtype: str | None = None,
        bf16_master_weights_and_grads: bool = False,
        bf16_optimizer_states: bool = False,
        zero_stage: int = 0,
        optimizer_offload: str = "none",
    ) -> PrecisionPolicy:
        """The policy of the precision keys: `fp16.enabled`, `bf16.enabled`, `torch_autocast.dtype` when
        `torch_autocast.enabled` (else None), `data_types.grad_accum_dtype`, bf16's master switches; the
        ZeRO stage and `offload_optimizer.device` for bf16 masters' rules. The errors name the keys."""
        if autocast is not None:
            _check_autocast(autocast, fp16, bf16)
        if fp16:
            return cls(param_dtype=torch.float16, grad_accum_dtype=_grad_accum(grad_accum_dtype, torch.float16))
        masters = _bf16_masters(
            bf16, bf16_master_weights_and_grads, bf16_optimizer_states, zero_stage, optimizer_offload
        )
        if bf16:
            if masters:
                return cls(
                    param_dtype=torch.bfloat16,
                    master_dtype=torch.bfloat16,
                    grad_accum_dtype=_grad_accum(grad_accum_dtype, torch.bfloat16, forced=True),
                )
            return cls(param_dtype=torch.bfloat16, grad_accum_dtype=_grad_accum(grad_accum_dtype, torch.bfloat16))
        _grad_accum(grad_accum_dtype, torch.float32)
        if autocast is not None:
            return cls(autocast_dtype=_DTYPES[autocast])
        return cls()


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _check_autocast(dtype: str, fp16: bool, bf16: bool) -> None:
    """DeepSpeed's conditions for `torch_autocast`: a 16-bit dtype, no fp16/bf16 section."""
    if dtype not in ("bf16", "fp16"):
        raise ConfigError(
            f"torch_autocast.dtype={dtype!r}: autocast runs the forward in a "
            'lower precision; give "bf16" or "fp16" (or set torch_autocast.enabled=false)'
        )
    for key, on in (("fp16", fp16), ("bf16", bf16)):
        if on:
            raise ConfigError(
                f"torch_autocast.enabled=true and {key}.enabled=true: torch autocast keeps fp32 "
                f"parameters and casts inside the forward, {key} casts the model; choose one "
                f"(set {key}.enabled=false, or torch_autocast.enabled=false)"
            )


def _grad_accum(asked: str | None, model_dtype: torch.dtype, forced: bool = False) -> torch.dtype:
    """`data_types.grad_accum_dtype`: the dtype gradients accumulate (and their ZeRO partitions live) in:
    fp32 by default, or the model's own 16-bit dtype (half the gradient memory, each accumulation
    rounded to it); `forced`: bf16 masters take bf16 gradients (Note [bf16 masters])."""
    if forced:
        if asked not in (None, "bf16"):
            raise ConfigError(
                f"data_types.grad_accum_dtype={asked!r} with bf16.bf16_master_weights_and_grads=true: "
                'bf16 masters accumulate their gradients in bf16; drop the key or set "bf16"'
            )
        return torch.bfloat16
    dtype = _DTYPES[asked or "fp32"]
    if dtype not in (torch.float32, model_dtype):
        model = {torch.float32: "fp32 (no fp16 / bf16 section)", torch.float16: "fp16", torch.bfloat16: "bf16"}
        raise ConfigError(
            f"data_types.grad_accum_dtype={asked!r} with a model trained in {model[model_dtype]}: "
            "gradients accumulate in fp32 or in the model's own dtype; set one of those"
        )
    return dtype


def _bf16_masters(enabled: bool, masters: bool, states: bool, zero_stage: int, optimizer_offload: str) -> bool:
    """Note [bf16 masters]: `bf16.bf16_master_weights_and_grads` (with `bf16_optimizer_states`), DeepSpeed's
    low-precision optimizer: the ZeRO partitions of the master weights, their gradients and the optimizer
    states are bf16, and the masters are the bf16 weights' own partitions (no copy). Per trained element
    Adam then holds 2 (weight) + 2 (gradient) + 4 (two moments) bytes instead of 2 + 4 + 4 + 8, at bf16's
    precision for the update itself: an update below half a bf16 ulp of its weight is lost. DeepSpeed's
    rules: bf16 on, ZeRO stage 1-3; bf16 states need bf16 masters; fp32 states over bf16 masters exist
    only through its CPU-Adam kernel (offload), which is not built here."""
    if not masters and not states:
        return False
    key = "bf16.bf16_master_weights_and_grads" if masters else "bf16.bf16_optimizer_states"
    if not enabled:
        raise ConfigError(f"{key}=true needs bf16.enabled=true (it keeps the bf16 training's masters in bf16)")
    if states and not masters:
        raise ConfigError(
            "bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads=true (the "
            "optimizer states follow the masters' dtype); set both"
        )
    if not states:
        raise ConfigError(
            "bf16.bf16_master_weights_and_grads=true with bf16_optimizer_states=false keeps fp32 "
            "optimizer states over bf16 masters, which DeepSpeed does only in its CPU-Adam kernel "
            "(offload); not built here: set bf16_optimizer_states=true too"
        )
    if zero_stage == 0:
        raise ConfigError(
            f"{key}=true needs ZeRO stage 1, 2 or 3 (zero_optimization.stage=0): the masters it "
            "keeps in bf16 are ZeRO's partitions"
        )
    if optimizer_offload != "none":
        raise ConfigError(
            f"{key}=true with zero_optimization.offload_optimizer.device="
            f"{optimizer_offload!r}: offloaded bf16 masters are not built; drop one"
        )
    return True
