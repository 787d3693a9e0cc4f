"""Group-wise weight-only quantization to int8 / int4: pure tensor math, no modules.

A weight [out, in] is cut along `in` into groups of `group_size` columns; each (row, group) gets its own
scale (and, asymmetric, its own minimum), so one outlier costs precision only within its group.

- asymmetric (DeepSpeed's ZeRO-Inference default): q = round((w - min) / scale), scale = (max - min) /
  (2^bits - 1), q in [0, 2^bits - 1]; w' = q * scale + min.
- symmetric: q = round(w / scale) + 2^(bits-1), scale = absmax / (2^(bits-1) - 1); w' = (q - 2^(bits-1)) * scale.

int4 values are packed two to a byte (even column in the low nibble), so the stored weight is
out x in / 2 bytes; int8 is out x in bytes. The scales (and minimums) are kept in the weight's own dtype.
Rounding error per element is at most scale / 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    data: torch.Tensor          # uint8 [out, in] (int8) or [out, in / 2] (int4, packed)
    scale: torch.Tensor         # [out, groups]
    minimum: torch.Tensor | None  # [out, groups] for asymmetric, None for symmetric
    shape: tuple[int, int]
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimum is None else self.minimum.numel() * self.minimum.element_size()
        return self.data.numel() + self.scale.numel() * self.scale.element_size() + extra


def check_settings(shape: tuple[int, ...], bits: int, group_size: int, what: str = "weight") -> None:
    if bits not in (4, 8):
        raise ValueError(f"{what}: num_bits = {bits}; weight-only quantization supports 4 and 8")
    if len(shape) != 2 or shape[1] % group_size or group_size < 1 or bits == 4 and group_size % 2:
        raise ValueError(f"{what}: shape {tuple(shape)} cannot be cut into groups of {group_size} input features"
                         f"{' (int4 needs an even group size)' if bits == 4 else ''}; choose a group_size dividing "
                         f"{shape[-1]}")


def _pack4(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2], out[:, 1::2] = packed & 0xF, packed >> 4
    return out


def quantize(weight: torch.Tensor, bits: int = 8, group_size: int = 64, symmetric: bool = False) -> QuantizedWeight:
    """Quantize a [out, in] weight group-wise along `in`."""
    check_settings(tuple(weight.shape), bits, group_size)
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // group_size, group_size)
    levels = 2 ** bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = (w.abs().amax(-1, keepdim=True) / (half - 1)).clamp_min(torch.finfo(torch.float32).tiny)
        q = (torch.round(w / scale) + half).clamp(0, levels)
        minimum = None
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round((w - lo) / scale).clamp(0, levels)
        minimum = lo[..., 0].to(weight.dtype)
    q = q.to(torch.uint8).reshape(out, inp)
    return QuantizedWeight(_pack4(q) if bits == 4 else q, scale[..., 0].to(weight.dtype), minimum, (out, inp), bits,
                           group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [out, in] weight the quantized one stands for."""
    q = _unpack4(qw.data) if qw.bits == 4 else qw.data
    out, inp = qw.shape
    q = q.reshape(out, inp // qw.group_size, qw.group_size).to(qw.scale.dtype)
    scale = qw.scale[..., None]
    if qw.minimum is None:
        w = (q - 2 ** (qw.bits - 1)) * scale
    else:
        w = q * scale + qw.minimum[..., None]
    return w.reshape(out, inp).to(dtype or qw.scale.dtype)
