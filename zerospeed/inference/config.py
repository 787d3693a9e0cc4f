"""``DeepSpeedInferenceConfig``: the typed config of `init_inference`, with DeepSpeed 0.19's fields,
defaults and aliases.

Every field of DeepSpeed's inference config parses (unknown ones are errors naming the key, as in the
training config). A field that parses but asks for something zerospeed does not do (CUDA graphs,
Triton kernels, int8 weights, expert parallelism at inference) is refused by the engine with a
`ConfigError` naming it (`unsupported()` below), never silently ignored. Alternative spellings and
DeepSpeed's deprecated top-level keys are rewritten first (aliases.py).

Fields that hold Python objects (a tp group, an mpu, an injection policy keyed by module classes) are
accepted as given: `init_inference` takes them as keyword arguments, not from JSON.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, ConfigDict, ValidationError, model_validator

from zerospeed.config.schema.base import (
    Bool,
    IntList,
    OptStr,
    PosInt,
    Str,
    StrictModel,
    choice_type,
    ds_field,
    ds_section,
    fail,
    int_type,
    show,
)
from zerospeed.config.schema.zero import ZeroConfig
from zerospeed.config.validation import dotted, model_at
from zerospeed.inference.aliases import apply_inference_aliases
from zerospeed.utils.errors import ConfigError

_DTYPES = {
    torch.float16: torch.float16,
    "torch.float16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    torch.float32: torch.float32,
    "torch.float32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    torch.bfloat16: torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bfloat": torch.bfloat16,
    torch.int8: torch.int8,
    "torch.int8": torch.int8,
    "int8": torch.int8,
}


def _dtype(value: Any) -> torch.dtype:
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (str, torch.dtype)) and key in _DTYPES:
        return _DTYPES[key]
    raise fail('torch.float16, torch.bfloat16, torch.float32 or torch.int8 (or a name such as "fp16")', value)


Dtype = Annotated[Any, BeforeValidator(_dtype)]
AnyObject = Annotated[Any, BeforeValidator(lambda v: v)]  # a process group, an mpu: passed through
OptPosInt = int_type(minimum=1, nullable=True)


def _checkpoint(value: Any) -> Any:
    if value is None or isinstance(value, (str, dict)):
        return value
    if hasattr(value, "__fspath__"):
        return str(value.__fspath__())
    raise fail("a path (to a checkpoint file, directory or DeepSpeed checkpoint JSON) or a JSON object", value)


def _injection_policy(value: Any) -> Any:
    """{module class (or its name): row-parallel linear name(s) in it}: DeepSpeed's injection_dict."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail('an object {ModuleClass: ("attn.out_proj", "mlp.down_proj")}', value)
    out = {}
    for key, names in value.items():
        if not (isinstance(key, str) or isinstance(key, type) and issubclass(key, torch.nn.Module)):
            raise fail("nn.Module subclasses (or class names) as keys", key)
        names = (names,) if isinstance(names, str) else names
        if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
            raise fail("a layer name or a tuple of layer names for each module class", value[key])
        out[key] = tuple(names)
    return out


class TPConfig(StrictModel):
    """``tensor_parallel`` (alias ``tp``): split the model over tp_size ranks with AutoTP."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    enabled: Bool = ds_field(True, "Turn tensor parallelism on/off.")
    tp_size: PosInt = ds_field(1, "Ranks the model is split across.")
    tp_grain_size: PosInt = ds_field(64, "Granularity of MLP/lm_head splits (DeepSpeed's uneven AutoTP).")
    mpu: AnyObject = ds_field(None, "A model-parallel unit; its model-parallel group becomes the tp group.")
    tp_group: AnyObject = ds_field(None, "An existing process group to shard over (else one is made).")


class MoEConfig(StrictModel):
    """``moe``: mixture-of-experts settings of the model being served."""

    enabled: Bool = ds_field(True, "The model has MoE layers.")
    ep_size: PosInt = ds_field(1, "Expert-parallel degree at inference.")
    moe_experts: IntList = ds_field([1], "Global number of experts per MoE layer (alias num_experts).")
    type: choice_type("standard", "residual") = ds_field("standard", "MoE layer type: standard or residual.")
    ep_mp_group: AnyObject = ds_field(None, "Expert-model-parallel process group.")
    ep_group: AnyObject = ds_field(None, "Expert-parallel process group (alias expert_group).")


QType = choice_type("symmetric", "asymmetric", synonyms={"sym": "symmetric", "asym": "asymmetric"})


class ActivationQuantConfig(StrictModel):
    """``quant.activation``."""

    enabled: Bool = ds_field(True, "Quantize activations.")
    num_bits: PosInt = ds_field(8, "Bits per value.")
    q_type: QType = ds_field("symmetric", "symmetric or asymmetric.")
    q_groups: PosInt = ds_field(1, "Quantization groups.")


class WeightQuantConfig(ActivationQuantConfig):
    """``quant.weight``."""

    quantized_initialization: dict[str, Any] = ds_field(
        {}, "Weight-only quantization of every linear layer: {num_bits: 4|8, group_size, symmetric}."
    )
    post_init_quant: dict[str, Any] = ds_field(
        {}, 'Weight-only quantization per layer-name substring: {"mlp": {num_bits, group_size, symmetric}}.'
    )


class QKVQuantConfig(StrictModel):
    """``quant.qkv``."""

    enabled: Bool = ds_field(True, "Quantize the fused qkv projection.")


class QuantConfig(StrictModel):
    """``quant``: quantization. ``weight.post_init_quant`` / ``weight.quantized_initialization`` give weight-only
    group-wise int8/int4 (quantize/); MoQ (``dtype`` int8 with activation quantization) is not implemented."""

    enabled: Bool = ds_field(True, "Quantization on (takes effect only with dtype int8).")
    activation: ActivationQuantConfig = ds_section(ActivationQuantConfig, "Activation quantization.")
    weight: WeightQuantConfig = ds_section(WeightQuantConfig, "Weight quantization.")
    qkv: QKVQuantConfig = ds_section(QKVQuantConfig, "qkv quantization.")


class CheckpointConfig(StrictModel):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: OptStr = ds_field(None, "Directory of the checkpoint.")
    save_mp_checkpoint_path: OptStr = ds_field(None, "Where to save the tp-sharded checkpoint.")
    base_dir: OptStr = ds_field(None, "Root directory of the checkpoint files.")


class DeepSpeedInferenceConfig(StrictModel):
    """The inference engine's config: DeepSpeed 0.19's fields and defaults (see docs/inference.md)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())
    replace_with_kernel_inject: Bool = ds_field(
        False, "Inject fused kernels (alias kernel_inject). zerospeed has none: the model runs its own forward."
    )
    dtype: Dtype = ds_field(torch.float16, "Data type the model is converted to.")
    tensor_parallel: TPConfig = ds_section(TPConfig, "Tensor parallelism (alias tp).")
    enable_cuda_graph: Bool = ds_field(False, "Capture the forward in a CUDA graph.")
    use_triton: Bool = ds_field(False, "Use Triton kernels.")
    triton_autotune: Bool = ds_field(False, "Autotune the Triton kernels.")
    zero: ZeroConfig = ds_section(ZeroConfig, "ZeRO settings for ZeRO-Inference (stage 3 + offload_param).")
    triangular_masking: Bool = ds_field(True, "Causal masking in injected kernels (alias tm).")
    moe: MoEConfig = ds_section(MoEConfig, "MoE settings; a bare true/false sets moe.enabled.")
    keep_module_on_host: Bool = ds_field(False, "Leave the model on the host instead of moving it to the device.")
    quant: QuantConfig = ds_section(QuantConfig, "MoQ quantization settings (with dtype int8).")
    checkpoint: Annotated[Any, BeforeValidator(_checkpoint)] = ds_field(
        None, "Checkpoint to load: a file, a directory, or DeepSpeed's checkpoint JSON (path or object)."
    )
    base_dir: Str = ds_field("", "Root directory the checkpoint JSON's file names are relative to.")
    set_empty_params: Bool = ds_field(False, "Build the injected modules with empty tensors.")
    save_mp_checkpoint_path: OptStr = ds_field(None, "Save the tp-sharded model here after loading.")
    checkpoint_config: CheckpointConfig = ds_section(CheckpointConfig, "Checkpoint settings (alias ckpt_config).")
    return_tuple: Bool = ds_field(True, "Injected layers return tuples.")
    training_mp_size: PosInt = ds_field(1, "Model-parallel size the checkpoint was trained with.")
    replace_method: Str = ds_field("auto", "Deprecated; no longer needed.")
    injection_policy: Annotated[Any, BeforeValidator(_injection_policy)] = ds_field(
        None, "{module class: its row-parallel linear names}: manual TP (alias injection_dict)."
    )
    injection_policy_tuple: Annotated[Any, BeforeValidator(lambda v: v)] = ds_field(None, "Internal to DeepSpeed.")
    config: Annotated[Any, BeforeValidator(lambda v: v)] = ds_field(None, "Model config for injection (alias args).")
    max_out_tokens: PosInt = ds_field(1024, "Most tokens (prompt and output) per sequence (alias max_tokens).")
    min_out_tokens: PosInt = ds_field(1, "Fewest output tokens the runtime must be able to produce (alias min_tokens).")
    transposed_mode: Bool = ds_field(False, "Injected kernels' transposed weight layout.")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, raw: Any) -> Any:
        """DeepSpeed's other spellings also for a config built directly: `DeepSpeedInferenceConfig(mp_size=2)`."""
        return apply_inference_aliases(raw) if isinstance(raw, dict) else raw

    def weight_quantization(self) -> bool:
        """Weight-only int8/int4 quantization asked for (quant.weight.post_init_quant or quantized_initialization)."""
        w = self.quant.weight
        return self.quant.enabled and w.enabled and bool(w.post_init_quant or w.quantized_initialization)

    def unsupported(self) -> list[str]:
        """Settings that parse but that zerospeed does not do: one line each, naming the key and the way out."""
        problems = []
        if self.dtype is torch.int8:
            problems.append(
                "dtype: int8 (MoQ int8 inference) is not implemented; use torch.float16, "
                "torch.bfloat16 or torch.float32"
            )
        for key in ("enable_cuda_graph", "use_triton", "triton_autotune"):
            if getattr(self, key):
                problems.append(
                    f"{key}: true is not implemented (zerospeed has no CUDA-graph or Triton inference path); remove it"
                )
        if self.moe.ep_size > 1:
            problems.append(
                f"moe.ep_size: {self.moe.ep_size}: expert parallelism at inference is not implemented; "
                "use 1 (the experts stay whole on every rank)"
            )
        if self.save_mp_checkpoint_path or self.checkpoint_config.save_mp_checkpoint_path:
            problems.append(
                "save_mp_checkpoint_path: saving tp-sharded inference checkpoints is not implemented; remove it"
            )
        if self.set_empty_params:
            problems.append("set_empty_params: true is not implemented; remove it")
        if self.training_mp_size != 1:
            problems.append(
                f"training_mp_size: {self.training_mp_size}: loading a model-parallel training "
                "checkpoint is not implemented; consolidate it first (zerospeed.checkpoint)"
            )
        if self.replace_with_kernel_inject and self.injection_policy:
            problems.append("replace_with_kernel_inject and injection_policy: give one (DeepSpeed refuses both too)")
        if self.zero.stage not in (0, 3):
            problems.append(
                f"zero.stage: {self.zero.stage}: ZeRO-Inference is stage 3 (with offload_param); "
                "use 3 or leave zero out"
            )
        return problems


def _unknown_key(loc: tuple[Any, ...]) -> str:
    model = model_at(loc[:-1], root=DeepSpeedInferenceConfig)
    valid = sorted(model.model_fields) if model else []
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    return f"unknown key — did you mean {close[0]}?" if close else "unknown key (not a DeepSpeed inference key)"


def _line(error: dict[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return f"{dotted(error['loc'])}: {_unknown_key(error['loc'])}"
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"{dotted(error['loc'])}: expected an object ({{...}}), got {show(error.get('input'))}"
    message = error["msg"].removeprefix("Value error, ").rstrip(".")
    return f"{dotted(error['loc'])}: {message}" if error["loc"] else message


def validate_inference_config(raw: dict[str, Any]) -> DeepSpeedInferenceConfig:
    """Validate an alias-resolved dict; every problem is one line of the `ConfigError`."""
    try:
        return DeepSpeedInferenceConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_line(e) for e in exc.errors(include_url=False)]
        head = "" if len(lines) == 1 else f"{len(lines)} problems in the inference config:\n"
        raise ConfigError(head + "\n".join(lines)) from None
