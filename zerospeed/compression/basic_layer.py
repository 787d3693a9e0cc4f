"""``LinearLayer_Compress`` and ``Conv2dLayer_Compress`` (DeepSpeed's names): an ``nn.Linear`` /
``nn.Conv2d`` that fake-quantizes and masks its weight (and fake-quantizes its input) in forward, as
its techniques' schedules say, and ``QuantizedLinear``, the stored form.

A compressed layer *shares* the original module's ``weight`` and ``bias`` Parameters, so state-dict
keys, weight tying and optimizer parameter lists stay as they were. Its technique settings are
explicit fields set by ``init_compression``; ``set_step`` (called by the compression scheduler)
moves it along its schedules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.compression.prune import (
    channel_l1_mask,
    expand_head_mask,
    head_l1_mask,
    row_l1_mask,
    sparse_l1_mask,
    topk_mask_ste,
)
from zerospeed.compression.quantize import (
    ActivationRange,
    activation_codes,
    bits_at_step,
    ste_quantize,
    ste_quantize_activation,
)
from zerospeed.zero import GatheredParameters


@dataclass(frozen=True)
class WeightQuantSpec:
    start_bits: int
    target_bits: int
    period: int
    offset: int
    groups: int
    symmetric: bool
    stochastic: bool


@dataclass(frozen=True)
class ActivationQuantSpec:
    bits: int
    symmetric: bool
    static: bool  # range_calibration "static" (a tracked range) or "dynamic" (per token)
    offset: int


@dataclass(frozen=True)
class PruneSpec:
    method: str  # "l1" | "topk"
    dense_ratio: float
    offset: int
    num_heads: int | None = None  # head pruning only


class _Compressible:
    """The schedule and mask machinery shared by the compressed layers.

    A layer names its mask kinds in ``MASKS``: kind -> (mask shape, l1 mask function of the layer).
    """

    MASKS: dict[str, tuple[Callable[[nn.Module], tuple], Callable[[nn.Module, PruneSpec], torch.Tensor]]] = {}
    training_steps: int

    def _init_compression_state(self) -> None:
        self.specs: dict[str, PruneSpec] = {}
        self.act_quant: ActivationQuantSpec | None = None
        self.training_steps = 0
        self._mask_ready: set[str] = set()

    def enable_pruning(self, kind: str, spec: PruneSpec) -> None:
        self.specs[kind] = spec
        shape = self.MASKS[kind][0](self)
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        if spec.method == "topk":
            scores = torch.empty(shape, **like)
            nn.init.kaiming_uniform_(scores, a=5**0.5)
            self.register_parameter(f"{kind}_mask_scores", nn.Parameter(scores))
        else:
            # Note [l1 mask timing]: the mask is (re)computed from the weights when pruning turns on
            # (set_step reaching schedule_offset), not frozen from the initial weights; with offset 0
            # the two agree. It is a buffer, so checkpoints carry it.
            self.register_buffer(f"{kind}_pruning_mask", torch.ones(shape, **like))
        if spec.offset <= self.training_steps:
            self._refresh_l1(kind)

    def enable_activation_quantization(self, spec: ActivationQuantSpec) -> None:
        self.act_quant = spec
        if spec.static:
            self.activation_range = ActivationRange()

    def _refresh_l1(self, kind: str) -> None:
        spec = self.specs[kind]
        if spec.method != "l1":
            return
        # under ZeRO-3 the weight is a shard outside forward: gather it (a no-op for a plain Parameter)
        with torch.no_grad(), GatheredParameters([self.weight]):
            getattr(self, f"{kind}_pruning_mask").copy_(self.MASKS[kind][1](self, spec))
        self._mask_ready.add(kind)

    def set_step(self, step: int) -> None:
        """Move to global step ``step``; l1 masks are computed the first time pruning is active."""
        self.training_steps = step
        for kind, spec in self.specs.items():
            if spec.method == "l1" and step >= spec.offset and kind not in self._mask_ready:
                self._refresh_l1(kind)

    def mask(self, kind: str) -> torch.Tensor | None:
        """The active mask of ``kind`` (see ``MASKS``), or None while that pruning is off."""
        spec = self.specs.get(kind)
        if spec is None or self.training_steps < spec.offset:
            return None
        if spec.method == "topk":
            return topk_mask_ste(getattr(self, f"{kind}_mask_scores"), spec.dense_ratio)
        return getattr(self, f"{kind}_pruning_mask")

    SAMPLE_WISE = False  # dynamic activation ranges per token (Linear) or per sample (Conv2d)

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fake-quantized when activation quantization is active, else ``x``."""
        a = self.act_quant
        if a is None or self.training_steps < a.offset:
            return x
        x_range = self.activation_range(x) if a.static else None
        return ste_quantize_activation(x, a.bits, a.symmetric, x_range, self.SAMPLE_WISE)


class LinearLayer_Compress(_Compressible, nn.Linear):
    """A Linear with optional weight QAT, activation quantization and sparse / row / head pruning.

    Head pruning applies to an attention *output* projection: its input columns come in
    ``num_heads`` blocks, one per head.
    """

    MASKS = {
        "sparse": (lambda m: tuple(m.weight.shape), lambda m, s: sparse_l1_mask(m.weight, s.dense_ratio)),
        "row": (lambda m: (m.out_features, 1), lambda m, s: row_l1_mask(m.weight, s.dense_ratio)),
        "head": (
            lambda m: (1, m.specs["head"].num_heads),
            lambda m, s: head_l1_mask(m.weight, s.num_heads, s.dense_ratio),
        ),
    }

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_quant: WeightQuantSpec | None = None
        self._init_compression_state()

    # -- configuration (init_compression) --------------------------------------------------------
    def enable_weight_quantization(self, spec: WeightQuantSpec) -> None:
        self.weight_quant = spec

    def current_bits(self) -> int | None:
        """Bits of the weight now, or None while weight quantization is off."""
        q = self.weight_quant
        if q is None or self.training_steps < q.offset:
            return None
        return bits_at_step(self.training_steps - q.offset, q.start_bits, q.target_bits, q.period)

    # -- forward ---------------------------------------------------------------------------------
    def effective_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.weight, self.bias
        bits = self.current_bits()
        if bits is not None:
            q = self.weight_quant
            weight = ste_quantize(weight, bits, q.groups, q.symmetric, q.stochastic and self.training)
        sparse = self.mask("sparse")
        if sparse is not None:
            weight = weight * sparse
        row = self.mask("row")
        if row is not None:
            weight = weight * row
            bias = bias * row.view(-1) if bias is not None else None
        head = self.mask("head")
        if head is not None:
            weight = weight * expand_head_mask(head, self.in_features)
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight_and_bias()
        return F.linear(self.quantized_input(x), weight, bias)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, weight_quant={self.weight_quant}, act_quant={self.act_quant}, "
            f"pruning={self.specs}, step={self.training_steps}"
        )


class Conv2dLayer_Compress(_Compressible, nn.Conv2d):
    """A Conv2d with optional channel pruning (output channels) and activation quantization."""

    SAMPLE_WISE = True
    MASKS = {"channel": (lambda m: (m.out_channels, 1, 1, 1), lambda m, s: channel_l1_mask(m.weight, s.dense_ratio))}

    def __init__(self, conv: nn.Conv2d):
        super().__init__(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",
        )
        self.weight = conv.weight
        self.bias = conv.bias
        self._init_compression_state()

    def effective_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.weight, self.bias
        channel = self.mask("channel")
        if channel is not None:
            weight = weight * channel
            bias = bias * channel.view(-1) if bias is not None else None
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight_and_bias()
        return self._conv_forward(self.quantized_input(x), weight, bias)


def storage_width(bits: int) -> int:
    """Bits each stored code takes: 1 (binary), 2 (ternary), 4 (3-4 bits, two per byte) or 8."""
    return 1 if bits == 1 else 2 if bits == 2 else 4 if bits <= 4 else 8


def pack_codes(codes_OI: torch.Tensor, width: int, symmetric: bool) -> torch.Tensor:
    """Codes of ``width`` bits (1, 2 or 4), ``8 // width`` per byte along the input dimension (the last
    byte of a row padded), lowest bits first. Symmetric codes are stored offset by ``2**(width-1)``
    (4 bits: [-8, 7]; 2 bits: the ternary [-1, 1]); binary codes -1 / +1 as 0 / 1; asymmetric ones
    (4 bits only) as they are."""
    c = codes_OI.to(torch.int16)
    if symmetric:
        c = (c + 1) // 2 if width == 1 else c + (1 << (width - 1))
    per = 8 // width
    pad = (-c.shape[1]) % per
    u = torch.cat([c, c.new_zeros(c.shape[0], pad)], dim=1).to(torch.uint8) if pad else c.to(torch.uint8)
    u = u.view(u.shape[0], -1, per)
    out = torch.zeros(u.shape[:2], dtype=torch.uint8, device=u.device)
    for i in range(per):
        out |= u[:, :, i] << (i * width)
    return out.contiguous()


def unpack_codes(packed: torch.Tensor, in_features: int, width: int, symmetric: bool) -> torch.Tensor:
    """The int16 codes ``pack_codes`` packed."""
    per, lane = 8 // width, (1 << width) - 1
    u = torch.stack([(packed >> (i * width)) & lane for i in range(per)], dim=2)
    c = u.reshape(packed.shape[0], -1)[:, :in_features].to(torch.int16)
    if symmetric:
        c = 2 * c - 1 if width == 1 else c - (1 << (width - 1))
    return c


class QuantizedLinear(nn.Module):
    """A Linear stored as integer codes with a per-row scale and zero point (``redundancy_clean``).

    Codes are int8 (symmetric) or uint8 (asymmetric); with `bits` <= 4 they are packed into bytes
    (``storage_width``: 3-4 bits two per byte, ternary four, binary eight; `weight_codes` is then
    [out, ceil(in / per byte)] uint8). Forward dequantizes and runs a float matmul. Per-row scales
    let rows and columns be removed without requantizing.

    Note [integer matmul]: with ``integer_matmul = True``, a W8A8 layer (symmetric int8 codes, 8-bit
    symmetric input quantization) multiplies the int8 codes themselves (``torch._int_mm``, int32
    accumulation, exact) and scales the result by the token's and the row's scales: the same numbers
    as the float path up to float rounding. Off by default: on a CPU PyTorch's int8 kernel is slower
    than an fp32 matmul (benchmarks/compression.py measures both); on a GPU it is the fast one.
    """

    integer_matmul = False

    def __init__(
        self,
        codes_OI: torch.Tensor,
        scale_O: torch.Tensor,
        zero_O: torch.Tensor,
        bias: torch.Tensor | None,
        symmetric: bool,
        bits: int = 8,
    ):
        super().__init__()
        self.symmetric, self.width = symmetric, storage_width(bits)
        self.packed = self.width < 8
        self._in = codes_OI.shape[1]
        codes = (
            pack_codes(codes_OI, self.width, symmetric)
            if self.packed
            else codes_OI.to(torch.int8 if symmetric else torch.uint8)
        )
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", scale_O.float().contiguous())
        self.register_buffer("weight_zero", zero_O.float().contiguous() if not symmetric else None)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.act_quant: ActivationQuantSpec | None = None

    def enable_activation_quantization(self, spec: ActivationQuantSpec) -> None:
        """Quantize the input too (always on: the stored form of a layer whose schedule reached it)."""
        self.act_quant = spec
        if spec.static:
            self.activation_range = ActivationRange()

    @property
    def out_features(self) -> int:
        return self.weight_codes.shape[0]

    @property
    def in_features(self) -> int:
        return self._in

    def codes(self) -> torch.Tensor:
        """The integer codes, [out, in] (unpacked when stored two per byte)."""
        return (
            unpack_codes(self.weight_codes, self._in, self.width, self.symmetric) if self.packed else self.weight_codes
        )

    def dequantized_weight(self) -> torch.Tensor:
        codes = self.codes().float()
        if self.weight_zero is not None:
            codes = codes - self.weight_zero.view(-1, 1)
        return codes * self.weight_scale.view(-1, 1)

    def keep_rows(self, idx: torch.Tensor) -> None:
        self.weight_codes = self.weight_codes[idx].contiguous()
        self.weight_scale = self.weight_scale[idx].contiguous()
        if self.weight_zero is not None:
            self.weight_zero = self.weight_zero[idx].contiguous()
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach()[idx].clone())

    def keep_cols(self, idx: torch.Tensor) -> None:
        kept = self.codes()[:, idx].contiguous()
        self._in = kept.shape[1]
        self.weight_codes = pack_codes(kept, self.width, self.symmetric) if self.packed else kept

    def _w8a8(self) -> bool:
        a = self.act_quant
        return (
            self.integer_matmul and a is not None and a.bits == 8 and a.symmetric and self.symmetric and not self.packed
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act_quant
        x_range = self.activation_range(x) if a is not None and a.static else None
        if self._w8a8() and not (torch.is_grad_enabled() and x.requires_grad):
            c = activation_codes(x, 8, True, x_range)
            acc_TO = torch._int_mm(c.codes.to(torch.int8), self.weight_codes.t())
            y = (acc_TO.float() * c.scale * self.weight_scale.view(1, -1)).to(x.dtype)
            y = y if self.bias is None else y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if a is not None:
            x = ste_quantize_activation(x, a.bits, a.symmetric, x_range)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight_codes.dtype}"
            f"{f', {self.width}-bit packed' if self.packed else ''}, act_quant={self.act_quant}"
        )
