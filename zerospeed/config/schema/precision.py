"""Mixed precision: ``fp16`` (with loss scaling), ``bf16``, apex ``amp``, ``torch_autocast``, ``data_types``."""

from __future__ import annotations

from zerospeed.config.schema.base import (
    DTYPE_SYNONYMS,
    Bool,
    JsonValue,
    NonNegInt,
    NonNegNum,
    OptDtype,
    OptStrList,
    PosInt,
    PosNum,
    StrictModel,
    choice_type,
    ds_field,
)


class Fp16Config(StrictModel):
    """``fp16``: fp16 mixed precision with static or dynamic loss scaling."""

    enabled: Bool = ds_field(False, "Train in fp16 mixed precision.")
    auto_cast: Bool = ds_field(False, "Cast the model inputs to fp16 automatically.")
    loss_scale: NonNegNum = ds_field(0.0, "Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: NonNegInt = ds_field(16, "Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: PosInt = ds_field(1000, "Overflow-free steps before the dynamic scale is raised.")
    hysteresis: PosInt = ds_field(2, "Overflows tolerated before the dynamic scale is lowered (delayed shift).")
    consecutive_hysteresis: Bool = ds_field(False, "Refill the hysteresis after every overflow-free step.")
    min_loss_scale: PosNum = ds_field(1.0, "Lower bound of the dynamic loss scale.")
    fp16_master_weights_and_grads: Bool = ds_field(False, "Keep ZeRO master weights/grads in fp16.")


class Bf16Config(StrictModel):
    """``bf16``: bfloat16 mixed precision (no loss scaling)."""

    enabled: Bool = ds_field(False, "Train in bf16 mixed precision.")
    immediate_grad_update: Bool = ds_field(False, "Apply gradient updates immediately, not delayed.")
    check_grad_overflow: Bool = ds_field(False, "Check bf16 gradients for overflow and skip such steps.")
    bf16_master_weights_and_grads: Bool = ds_field(False, "Keep ZeRO master weights/grads in bf16.")
    bf16_optimizer_states: Bool = ds_field(False, "Keep optimizer states in bf16 too.")


class AmpConfig(StrictModel):
    """``amp``: NVIDIA apex AMP; every key but ``enabled`` goes to ``apex.amp.initialize``."""

    enabled: Bool = ds_field(False, "Use apex AMP.")
    opt_level: JsonValue = ds_field(None, 'apex opt_level, e.g. "O1".')
    cast_model_type: JsonValue = ds_field(None, "apex cast_model_type.")
    patch_torch_functions: JsonValue = ds_field(None, "apex patch_torch_functions.")
    keep_batchnorm_fp32: JsonValue = ds_field(None, "apex keep_batchnorm_fp32.")
    master_weights: JsonValue = ds_field(None, "apex master_weights.")
    loss_scale: JsonValue = ds_field(None, 'apex loss_scale (a number or "dynamic").')
    cast_model_outputs: JsonValue = ds_field(None, "apex cast_model_outputs.")
    num_losses: JsonValue = ds_field(None, "apex num_losses.")
    verbosity: JsonValue = ds_field(None, "apex verbosity.")
    min_loss_scale: JsonValue = ds_field(None, "apex min_loss_scale.")
    max_loss_scale: JsonValue = ds_field(None, "apex max_loss_scale.")


class TorchAutocastConfig(StrictModel):
    """``torch_autocast``: PyTorch native autocast managed by the engine."""

    enabled: Bool = ds_field(False, "Run forward under torch.autocast.")
    dtype: choice_type("fp16", "bf16", synonyms=DTYPE_SYNONYMS) = ds_field(
        "bf16", "Lower-precision dtype for autocast (bfloat16 or float16)."
    )
    lower_precision_safe_modules: OptStrList = ds_field(
        None, "Module classes communicated in the lower precision; null = DeepSpeed's list."
    )


class DataTypesConfig(StrictModel):
    """``data_types``: dtypes for gradient accumulation, parameters and buffers."""

    grad_accum_dtype: OptDtype = ds_field(None, "Dtype of gradient accumulation; null matches the model.")
    param_dtype: OptDtype = ds_field(None, "Cast parameters to this dtype; null keeps the precision mode's.")
    buffer_dtype: OptDtype = ds_field(None, "Cast buffers to this dtype; null keeps their loaded dtype.")
