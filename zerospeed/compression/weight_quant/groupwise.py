"""Group-wise weight-only quantization to int8 / int4: the weight-shaped face of `precision.quantize`.

A weight [out, in] is cut along `in` into groups of `group_size` columns; each (row, group) gets its own
scale (and, asymmetric, its own minimum), so one outlier costs precision only within its group. Read row
by row, the (row, group) pairs are consecutive blocks of the flattened weight, so the math is
`quantize_blocks`' (Note [block grids] in precision/quantize.py) and this module only gives it shapes:

- asymmetric (DeepSpeed's ZeRO-Inference default): q = round((w - min) / scale), scale = (max - min) /
  (2^bits - 1), q in [0, 2^bits - 1]; w' = q * scale + min.
- symmetric: q = round(w / scale) + 2^(bits-1), scale = absmax / (2^(bits-1) - 1); w' = (q - 2^(bits-1)) * scale.

int4 values are packed two to a byte (even column in the low nibble), so the stored weight is
out x in / 2 bytes; int8 is out x in bytes. The scales (and minimums) are computed in fp32, floored at
the smallest normal fp32 (Note [zero scale]) and kept in the weight's own dtype, in which `dequantize`
computes. Rounding error per element is at most scale / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed.precision.quantize import BlockQuantized, dequantize_blocks, pack_int4, quantize_blocks, unpack_int4


@dataclass
class QuantizedWeight:
    data: torch.Tensor  # uint8 [out, in] (int8) or [out, in / 2] (int4, packed)
    scale: torch.Tensor  # [out, groups]
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
        raise ValueError(
            f"{what}: shape {tuple(shape)} cannot be cut into groups of {group_size} input features"
            f"{' (int4 needs an even group size)' if bits == 4 else ''}; choose a group_size dividing "
            f"{shape[-1]}"
        )


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Rows of an even number of int4 codes, two per byte (`pack_int4` row by row: rows of even length
    make the flat packing and the row-wise one the same bytes)."""
    return pack_int4(q).view(q.shape[0], -1)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    return unpack_int4(packed, packed.numel() * 2).view(packed.shape[0], -1)


def quantize(weight: torch.Tensor, bits: int = 8, group_size: int = 64, symmetric: bool = False) -> QuantizedWeight:
    """Quantize a [out, in] weight group-wise along `in`: its flattened form cut into blocks of
    `group_size` (each row holds whole groups), scales floored at the smallest normal fp32 and stored
    in the weight's dtype."""
    check_settings(tuple(weight.shape), bits, group_size)
    out, inp = weight.shape
    q = quantize_blocks(
        weight, bits, group_size, symmetric, min_scale=torch.finfo(torch.float32).tiny, scale_dtype=weight.dtype
    )
    minimum = None if q.minimum is None else q.minimum.view(out, -1)
    return QuantizedWeight(q.codes.view(out, -1), q.scale.view(out, -1), minimum, (out, inp), bits, group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [out, in] weight the quantized one stands for (computed in the scales' dtype)."""
    out, inp = qw.shape
    minimum = None if qw.minimum is None else qw.minimum.reshape(-1)
    q = BlockQuantized(qw.data.reshape(-1), qw.scale.reshape(-1), minimum, out * inp, qw.bits, qw.group_size)
    return dequantize_blocks(q, dtype or qw.scale.dtype).view(out, inp)
