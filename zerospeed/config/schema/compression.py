"""``compression_training``: the DeepSpeed compression library's block, typed and strict (DeepSpeed's
keys and defaults), down to each technique's ``shared_parameters`` and ``different_groups``.

The root config validates it with the rest; ``zerospeed.compression.config.parse_compression_config``
validates the block alone (``init_compression`` takes a config dict, path or JSON string). Every
problem names the dotted key, e.g.
``compression_training.weight_quantization.different_groups.wq1.params.start_bits``.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from zerospeed.config.schema.base import (
    Bool,
    Fraction,
    IntList,
    NonNegInt,
    OptNonNegInt,
    OptPosInt,
    PosInt,
    Str,
    StrictModel,
    StrList,
    choice_type,
    ds_field,
    ds_section,
    fail,
)

ROOT_KEY = "compression_training"
QuantType = choice_type("symmetric", "asymmetric")


def _check_patterns(patterns: list[str]) -> list[str]:
    for pattern in patterns:
        if pattern != "*":
            try:
                re.compile(pattern)
            except re.error as exc:
                raise fail('a regular expression (or "*")', pattern, str(exc)) from None
    return patterns


class _Group(StrictModel):
    """One entry of ``different_groups``: its ``params``, the modules it covers and their partners."""

    modules: StrList = ds_field(["*"], 'Module-name patterns (regex searched in the name; "*" = all).')
    related_modules: list[StrList] | None = ds_field(
        None, "Per ``modules`` entry, patterns of the modules whose input columns follow the pruned rows."
    )

    @model_validator(mode="after")
    def _patterns(self) -> _Group:
        _check_patterns(self.modules)
        for patterns in self.related_modules or []:
            _check_patterns(patterns)
        return self


# -- weight quantization -------------------------------------------------------------------------
class Fp16MixedQuantize(StrictModel):
    """``fp16_mixed_quantize``: blend fp16 and quantized weights (DeepSpeed's MoQ option)."""

    enabled: Bool = ds_field(False, "Mix fp16 and quantized weights.")
    quantize_change_ratio: Fraction = ds_field(0.001, "Ratio change per step.")


class WeightQuantShared(StrictModel):
    """``weight_quantization.shared_parameters``."""

    enabled: Bool = ds_field(False, "Quantize weights.")
    quantizer_kernel: Bool = ds_field(False, "Use DeepSpeed's CUDA kernel (same math here, in PyTorch).")
    schedule_offset: NonNegInt = ds_field(0, "Step at which quantization starts.")
    quantize_groups: PosInt = ds_field(1, "Groups per weight matrix, each with its own scale.")
    quantize_verbose: Bool = ds_field(False, "Log bit changes.")
    quantization_type: QuantType = ds_field("symmetric", "Symmetric or asymmetric.")
    quantize_weight_in_forward: Bool = ds_field(False, "Fake-quantize in forward (always so here).")
    rounding: choice_type("nearest", "stochastic") = ds_field("nearest", "Rounding mode.")
    fp16_mixed_quantize: Fp16MixedQuantize = ds_section(Fp16MixedQuantize, "fp16 mixing.")


class WeightQuantParams(StrictModel):
    """``weight_quantization.different_groups.<name>.params``."""

    start_bits: PosInt = Field(description="Bits when quantization starts. Required (DeepSpeed asserts it).")
    target_bits: PosInt = Field(description="Bits at the end of the schedule. Required.")
    quantization_period: PosInt = ds_field(1, "Steps before the first one-bit drop; doubles after each.")

    @model_validator(mode="after")
    def _bits(self) -> WeightQuantParams:
        if self.target_bits > self.start_bits:
            raise fail(f"target_bits <= start_bits ({self.start_bits})", self.target_bits)
        if self.start_bits > 8:
            raise fail("start_bits <= 8 (codes are stored as 8-bit integers)", self.start_bits)
        return self


class WeightQuantGroup(_Group):
    params: WeightQuantParams = Field(description="The group's bit schedule. Required.")


class _Technique(StrictModel):
    """A technique: ``shared_parameters`` plus named ``different_groups`` (needed once enabled)."""

    @model_validator(mode="after")
    def _groups_when_enabled(self) -> _Technique:
        if self.shared_parameters.enabled and not self.different_groups:
            raise fail(
                "at least one entry in different_groups (enabled is true)",
                {},
                "name a group with its params and modules",
            )
        return self


class WeightQuantization(_Technique):
    shared_parameters: WeightQuantShared = ds_section(WeightQuantShared, "Shared settings.")
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict, description="Groups. Default {}.")

    @model_validator(mode="after")
    def _extreme_bits_are_symmetric(self) -> WeightQuantization:
        for name, group in self.different_groups.items():
            if group.params.target_bits <= 2 and self.shared_parameters.quantization_type != "symmetric":
                raise fail(
                    f'shared_parameters.quantization_type "symmetric" (group {name} goes to '
                    f"{group.params.target_bits} bits: binary / ternary weights are symmetric)",
                    self.shared_parameters.quantization_type,
                )
        return self


# -- activation quantization ---------------------------------------------------------------------
class ActivationQuantShared(StrictModel):
    enabled: Bool = ds_field(False, "Quantize activations.")
    quantization_type: QuantType = ds_field("symmetric", "Symmetric or asymmetric.")
    range_calibration: choice_type("dynamic", "static") = ds_field("dynamic", "Range calibration.")
    schedule_offset: NonNegInt = ds_field(1000, "Step at which it starts.")


class ActivationQuantParams(StrictModel):
    bits: PosInt = Field(description="Activation bits, 4 or 8 (DeepSpeed's two). Required.")

    @field_validator("bits")
    @classmethod
    def _bits(cls, bits: int) -> int:
        if bits not in (4, 8):
            raise fail("4 or 8 (the activation bit widths DeepSpeed supports)", bits)
        return bits


class ActivationQuantGroup(_Group):
    params: ActivationQuantParams = Field(description="Group parameters. Required.")


class ActivationQuantization(_Technique):
    shared_parameters: ActivationQuantShared = ds_section(ActivationQuantShared, "Shared settings.")
    different_groups: dict[str, ActivationQuantGroup] = Field(default_factory=dict, description="Default {}.")


# -- pruning -------------------------------------------------------------------------------------
class RatioParams(StrictModel):
    """``params`` of a pruning group."""

    dense_ratio: Fraction = Field(description="Fraction of weights (rows, heads, channels) kept. Required.")

    @model_validator(mode="after")
    def _positive(self) -> RatioParams:
        if self.dense_ratio <= 0:
            raise fail("a dense_ratio in (0, 1]", self.dense_ratio)
        return self


class RatioGroup(_Group):
    params: RatioParams = Field(description="Group parameters. Required.")


class SparseShared(StrictModel):
    """``sparse_pruning.shared_parameters``."""

    enabled: Bool = ds_field(False, "Unstructured pruning.")
    method: choice_type("l1", "topk", "snip_momentum") = ds_field("l1", "Mask method.")
    schedule_offset: NonNegInt = ds_field(1000, "Step at which the mask is applied.")
    schedule_offset_end: OptNonNegInt = ds_field(None, "snip_momentum: last step (null = schedule_offset).")
    schedule_offset_stride: PosInt = ds_field(1, "snip_momentum: steps between mask updates.")
    block_pattern: Str = ds_field("4x1", "snip_momentum: block shape.")
    dense_ratio: Fraction = ds_field(0.1, "snip_momentum: final dense ratio.")
    excluded_modules: StrList = ds_field([], "snip_momentum: modules left dense.")


class _Pruning(_Technique):
    """A pruning technique: its groups each give a ``dense_ratio``."""

    different_groups: dict[str, RatioGroup] = Field(default_factory=dict, description="Groups. Default {}.")


class SparsePruning(_Pruning):
    shared_parameters: SparseShared = ds_section(SparseShared, "Shared settings.")


class RowShared(StrictModel):
    enabled: Bool = ds_field(False, "Prune output rows.")
    method: choice_type("l1", "topk") = ds_field("l1", "Mask method.")
    schedule_offset: NonNegInt = ds_field(1000, "Step at which the mask is applied.")


class RowPruning(_Pruning):
    shared_parameters: RowShared = ds_section(RowShared, "Shared settings.")


class HeadShared(StrictModel):
    enabled: Bool = ds_field(False, "Prune attention heads.")
    method: choice_type("l1", "topk") = ds_field("topk", "Mask method.")
    schedule_offset: NonNegInt = ds_field(1000, "Step at which the mask is applied.")
    num_heads: OptPosInt = ds_field(None, "Heads of the attention output projection.")


class HeadPruning(_Pruning):
    shared_parameters: HeadShared = ds_section(HeadShared, "Shared settings.")

    @model_validator(mode="after")
    def _num_heads(self) -> HeadPruning:
        if self.shared_parameters.enabled and self.shared_parameters.num_heads is None:
            raise fail(
                "shared_parameters.num_heads (the heads of the pruned projections)",
                None,
                "set it to the model's attention head count",
            )
        return self


class ChannelShared(StrictModel):
    enabled: Bool = ds_field(False, "Prune conv channels.")
    method: choice_type("l1", "topk") = ds_field("l1", "Mask method.")
    schedule_offset: NonNegInt = ds_field(1000, "Step at which the mask is applied.")


class ChannelPruning(_Pruning):
    shared_parameters: ChannelShared = ds_section(ChannelShared, "Shared settings.")


class LayerReduction(StrictModel):
    """``layer_reduction``: initialise a shallower student from chosen teacher layers."""

    enabled: Bool = ds_field(False, "Reduce layers.")
    keep_number_layer: OptPosInt = ds_field(None, "Layers the student keeps.")
    module_name_prefix: Str = ds_field("", 'Name of the layer list, e.g. "blocks" or "transformer.h".')
    teacher_layer: IntList = ds_field([], "Teacher layer copied into student layer i, per i.")
    other_module_name: StrList = ds_field([], "Other modules copied from the teacher (embeddings, head).")


class CompressionConfig(StrictModel):
    """The whole ``compression_training`` block."""

    weight_quantization: WeightQuantization = ds_section(WeightQuantization, "Weight quantization.")
    activation_quantization: ActivationQuantization = ds_section(ActivationQuantization, "Activations.")
    sparse_pruning: SparsePruning = ds_section(SparsePruning, "Unstructured pruning.")
    row_pruning: RowPruning = ds_section(RowPruning, "Row pruning.")
    head_pruning: HeadPruning = ds_section(HeadPruning, "Head pruning.")
    channel_pruning: ChannelPruning = ds_section(ChannelPruning, "Channel pruning.")
    layer_reduction: LayerReduction = ds_section(LayerReduction, "Layer reduction.")


TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
