"""``LinearLayer_Compress`` (DeepSpeed's name): an ``nn.Linear`` that fake-quantizes and masks its
weight in forward, as its techniques' schedules say, and ``QuantizedLinear``, the stored form.

A compressed layer *shares* the original Linear's ``weight`` and ``bias`` Parameters, so state-dict
keys, weight tying and optimizer parameter lists stay as they were. Its technique settings are
explicit fields set by ``init_compression``; ``set_step`` (called by the compression scheduler)
moves it along its schedules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.compression.prune import row_l1_mask, sparse_l1_mask, topk_mask_ste
from zerospeed.compression.quantize import bits_at_step, ste_quantize


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
class PruneSpec:
    method: str  # "l1" | "topk"
    dense_ratio: float
    offset: int


class LinearLayer_Compress(nn.Linear):
    """A Linear with optional weight QAT, sparse pruning and row pruning."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_quant: WeightQuantSpec | None = None
        self.sparse: PruneSpec | None = None
        self.row: PruneSpec | None = None
        self.training_steps = 0
        self._mask_ready: set[str] = set()

    # -- configuration (init_compression) --------------------------------------------------------
    def enable_weight_quantization(self, spec: WeightQuantSpec) -> None:
        self.weight_quant = spec

    def enable_sparse_pruning(self, spec: PruneSpec) -> None:
        self.sparse = spec
        self._enable_mask("sparse", spec, self.weight.shape)

    def enable_row_pruning(self, spec: PruneSpec) -> None:
        self.row = spec
        self._enable_mask("row", spec, (self.out_features, 1))

    def _enable_mask(self, kind: str, spec: PruneSpec, shape) -> None:
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        if spec.method == "topk":
            scores = torch.empty(shape, **like)
            nn.init.kaiming_uniform_(scores, a=5 ** 0.5)
            self.register_parameter(f"{kind}_mask_scores", nn.Parameter(scores))
        else:
            # Note [l1 mask timing]: the mask is (re)computed from the weights when pruning turns on
            # (set_step reaching schedule_offset), not frozen from the initial weights; with offset 0
            # the two agree. It is a buffer, so checkpoints carry it.
            self.register_buffer(f"{kind}_pruning_mask", torch.ones(shape, **like))
        if spec.offset <= self.training_steps:
            self._refresh_l1(kind)

    def _refresh_l1(self, kind: str) -> None:
        spec = getattr(self, kind)
        if spec.method != "l1":
            return
        mask_fn = sparse_l1_mask if kind == "sparse" else row_l1_mask
        getattr(self, f"{kind}_pruning_mask").copy_(mask_fn(self.weight, spec.dense_ratio))
        self._mask_ready.add(kind)

    # -- schedule --------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Move to global step ``step``; l1 masks are computed the first time pruning is active."""
        self.training_steps = step
        for kind in ("sparse", "row"):
            spec = getattr(self, kind)
            if spec is not None and spec.method == "l1" and step >= spec.offset and kind not in self._mask_ready:
                with torch.no_grad():
                    self._refresh_l1(kind)

    def current_bits(self) -> int | None:
        """Bits of the weight now, or None while weight quantization is off."""
        q = self.weight_quant
        if q is None or self.training_steps < q.offset:
            return None
        return bits_at_step(self.training_steps - q.offset, q.start_bits, q.target_bits, q.period)

    def mask(self, kind: str) -> torch.Tensor | None:
        """The active ``"sparse"`` or ``"row"`` mask, or None while that pruning is off."""
        spec = getattr(self, kind)
        if spec is None or self.training_steps < spec.offset:
            return None
        if spec.method == "topk":
            return topk_mask_ste(getattr(self, f"{kind}_mask_scores"), spec.dense_ratio)
        return getattr(self, f"{kind}_pruning_mask")

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
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight_and_bias()
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, weight_quant={self.weight_quant}, sparse={self.sparse}, "
                f"row={self.row}, step={self.training_steps}")


def pack_nibbles(codes_OI: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """4-bit codes two per byte along the input dimension (an odd last column is padded): symmetric codes
    in [-8, 7] are stored offset by 8, asymmetric ones in [0, 15] as they are; low nibble first."""
    u = (codes_OI.to(torch.int16) + (8 if symmetric else 0)).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.cat([u, u.new_zeros(u.shape[0], 1)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, in_features: int, symmetric: bool) -> torch.Tensor:
    """The int16 codes `pack_nibbles` packed."""
    u = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(packed.shape[0], -1)[:, :in_features]
    return u.to(torch.int16) - (8 if symmetric else 0)


class QuantizedLinear(nn.Module):
    """A Linear stored as integer codes with a per-row scale and zero point (``redundancy_clean``).

    Codes are int8 (symmetric) or uint8 (asymmetric); with `bits` <= 4 they are packed two per byte
    (`weight_codes` is then [out, ceil(in / 2)] uint8). Forward dequantizes and runs a float matmul
    (no integer kernels yet). Per-row scales let rows and columns be removed without requantizing.
    """

    def __init__(self, codes_OI: torch.Tensor, scale_O: torch.Tensor, zero_O: torch.Tensor,
                 bias: torch.Tensor | None, symmetric: bool, bits: int = 8):
        super().__init__()
        self.symmetric, self.packed = symmetric, bits <= 4
        self._in = codes_OI.shape[1]
        codes = pack_nibbles(codes_OI, symmetric) if self.packed else codes_OI.to(torch.int8 if symmetric
                                                                                  else torch.uint8)
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", scale_O.float().contiguous())
        self.register_buffer("weight_zero", zero_O.float().contiguous() if not symmetric else None)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight_codes.shape[0]

    @property
    def in_features(self) -> int:
        return self._in

    def codes(self) -> torch.Tensor:
        """The integer codes, [out, in] (unpacked when stored two per byte)."""
        return unpack_nibbles(self.weight_codes, self._in, self.symmetric) if self.packed else self.weight_codes

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
        self.weight_codes = pack_nibbles(kept, self.symmetric) if self.packed else kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight_codes.dtype}"
                f"{', 4-bit packed' if self.packed else ''}")
