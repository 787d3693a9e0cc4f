"""Block quantization to int8 / int4: pure tensor math, no processes, no modules.

The one implementation of "cut into blocks, give each block a scale (and an offset), round onto the
grid, clamp, pack int4". Its users: ZeRO++'s wire format (`quantize_blocks` + `to_bytes`), the stored
shards of ZeRO-Inference, the weight-only layers of `compression.weight_quant` (a weight [out, in] cut
into row-wise column groups is the flat weight cut into consecutive blocks) and the QAT fake quantizers
of `compression.quantize` (`quantize_grid` / `dequantize_grid` on a [groups, n] view).

Note [block grids]: each block, a row of a [blocks, n] view, gets its own affine grid of integer codes,
so an outlier costs precision only within its block.

- symmetric: scale = absmax / (2^(bits-1) - 1), signed code q = round(x / scale) in
  [-(2^(bits-1) - 1), 2^(bits-1) - 1]; x' = q * scale. Stored (`quantize_blocks`) as the unsigned
  q + 2^(bits-1).
- asymmetric, minimum form (ZeRO++, ZeRO-Inference, weight-only layers): scale = (max - min) /
  (2^bits - 1), code = round((x - min) / scale) in [0, 2^bits - 1]; x' = code * scale + min.
- asymmetric, zero-point form (QAT, `zero_point=True`): the same scale and an integer zero point
  z = round(-min / scale); code = round(x / scale) + z clamped to [0, 2^bits - 1]; x' = (code - z) * scale.
  It is the minimum form's grid moved by less than half a step so that 0 is a level (an exact zero
  stays exact); in exchange the block's extremes may clamp one level short, and a block of one
  repeated non-zero value has no such grid (it does not dequantize to itself).

The range is the block's own [min, max] unless the caller passes one (`lo`, `hi`: QAT's static
activation ranges), in which case values outside it are clamped.

Rounding to nearest (half to even) errs by at most scale / 2 per element. Stochastic rounding rounds
v = x / scale down or up with probability 1 - frac(v) / frac(v), so E[x'] = x and |x - x'| < scale.

Note [zero scale]: a block of zeros (or of one repeated value, asymmetric) has scale 0 and
dequantizes exactly; the division then uses 1 in the scale's place. `min_scale` floors the scale
instead (the weight-only and QAT quantizers floor it at the smallest normal fp32): the same codes and
values for such a block, only the stored scale differs. Non-finite inputs make their block's scale
non-finite, so the whole block dequantizes to NaN/inf: an fp16 overflow check downstream still sees it.

The scale (and minimum) are computed in fp32 and stored in `scale_dtype` (fp32 on the wire; the
weight's dtype in the weight-only layers); dequantization computes in the stored scale's dtype and
rounds once to the requested one.

int4 codes are packed two to a byte (even element in the low nibble). On the wire (`to_bytes`) a
quantized tensor is one uint8 buffer: the fp32 scales, the fp32 minimums (asymmetric only), then the
codes — `wire_bytes` gives its length from integers alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

SCALE_BYTES = 4  # scales (and minimums) travel as fp32


@dataclass(frozen=True)
class BlockQuantized:
    codes: torch.Tensor  # uint8: numel codes (8-bit) or ceil(numel / 2) bytes of two codes (4-bit)
    scale: torch.Tensor  # [blocks], fp32 unless quantized with another scale_dtype
    minimum: torch.Tensor | None  # [blocks] in the scale's dtype, asymmetric only
    numel: int
    bits: int
    block_size: int

    @property
    def symmetric(self) -> bool:
        return self.minimum is None

    @property
    def nbytes(self) -> int:
        return wire_bytes(self.numel, self.bits, self.block_size, self.symmetric)


class Grid(NamedTuple):
    """Codes of a [blocks, n] tensor on per-block grids (Note [block grids])."""

    codes: torch.Tensor  # float [blocks, n] holding integers: signed (symmetric) or in [0, 2^bits - 1]
    scale: torch.Tensor  # fp32 [blocks, 1]
    offset: torch.Tensor | None  # [blocks, 1]: the minimum, or the zero point (zero_point=True); None symmetric


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else -(-numel // 2)


def wire_bytes(numel: int, bits: int, block_size: int, symmetric: bool = True) -> int:
    """Bytes of `to_bytes` for `numel` elements: the codes plus one (two, asymmetric) fp32 per block."""
    return code_bytes(numel, bits) + num_blocks(numel, block_size) * SCALE_BYTES * (1 if symmetric else 2)


def _check(bits: int, block_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"block quantization supports bits = 4 or 8, got {bits}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _round_(v: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    """`v` rounded in place: to nearest, or floor(v + u), u ~ U[0, 1) (rounds up with probability frac(v))."""
    if not stochastic:
        return v.round_()
    noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
    return v.add_(noise).floor_()


def quantize_grid(
    x_BN: torch.Tensor,
    bits: int,
    symmetric: bool = True,
    *,
    zero_point: bool = False,
    lo_B1: torch.Tensor | None = None,
    hi_B1: torch.Tensor | None = None,
    min_scale: float = 0.0,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Grid:
    """The codes of each row of the float `x_BN` on its `bits`-bit grid (Note [block grids]): spanning
    the row's own [min, max], or [`lo_B1`, `hi_B1`] when given (broadcast against [blocks, 1]); the
    scale floored at `min_scale` (Note [zero scale]). `x_BN` itself is never written to."""
    if lo_B1 is None or hi_B1 is None:
        lo_B1, hi_B1 = x_BN.amin(1, keepdim=True), x_BN.amax(1, keepdim=True)  # (torch.aminmax is slower on CPU)
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = torch.maximum(lo_B1.abs(), hi_B1.abs()) / top
        low, high = -top, top
    else:
        low, high = 0, 2**bits - 1
        scale = (hi_B1 - lo_B1) / high
    if min_scale > 0:
        scale = scale.clamp_min(min_scale)
    step = torch.where(scale == 0, 1.0, scale)
    offset = None
    if symmetric or zero_point:
        v = _round_(x_BN / step, stochastic, generator)
        if not symmetric:
            offset = torch.round(-lo_B1 / step)
            v.add_(offset)
    else:
        offset = lo_B1
        v = _round_((x_BN - lo_B1).div_(step), stochastic, generator)
    return Grid(v.clamp_(low, high), scale, offset)


def decode_(
    v_BN: torch.Tensor,
    scale_B1: torch.Tensor,
    offset_B1: torch.Tensor | None = None,
    *,
    zero_point: bool = False,
    shift: int = 0,
) -> torch.Tensor:
    """Codes -> values in place on the float buffer `v_BN` (Note [block grids]): (v - shift) * scale
    symmetric (`shift` undoes the storage's unsigned offset), v * scale + minimum, or
    (v - zero) * scale with `zero_point`."""
    if offset_B1 is None:
        return (v_BN.sub_(shift) if shift else v_BN).mul_(scale_B1)
    if zero_point:
        return v_BN.sub_(offset_B1).mul_(scale_B1)
    return v_BN.mul_(scale_B1).add_(offset_B1)


def dequantize_grid(
    codes_BN: torch.Tensor, scale_B1: torch.Tensor, offset_B1: torch.Tensor | None = None, *, zero_point: bool = False
) -> torch.Tensor:
    """The values of `quantize_grid`'s codes (a new tensor in the scale's dtype)."""
    return decode_(codes_BN.to(scale_B1.dtype, copy=True), scale_B1, offset_B1, zero_point=zero_point)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x as [blocks, block_size] fp32, the last block padded by repeating its first element (so the
    padding never widens the block's range)."""
    flat = x.detach().reshape(-1).float()
    n, blocks = flat.numel(), num_blocks(flat.numel(), block_size)
    pad = blocks * block_size - n
    if pad:
        flat = torch.cat([flat, flat[(blocks - 1) * block_size].expand(pad)])
    return flat.view(blocks, block_size)


def quantize_blocks(
    x: torch.Tensor,
    bits: int = 8,
    block_size: int = 512,
    symmetric: bool = True,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    *,
    min_scale: float = 0.0,
    scale_dtype: torch.dtype = torch.float32,
) -> BlockQuantized:
    """Quantize the flattened `x` block by block (Note [block grids], minimum form when asymmetric): uint8
    codes (int4 packed), the scale and minimum in `scale_dtype` (fp32 for `to_bytes`)."""
    _check(bits, block_size)
    numel = x.numel()
    if numel == 0:
        empty = torch.empty(0, dtype=scale_dtype, device=x.device)
        return BlockQuantized(
            torch.empty(0, dtype=torch.uint8, device=x.device), empty, None if symmetric else empty, 0, bits, block_size
        )
    g = quantize_grid(
        _blocks(x, block_size), bits, symmetric, min_scale=min_scale, stochastic=stochastic, generator=generator
    )
    v = g.codes.add_(2 ** (bits - 1)) if symmetric else g.codes
    codes = v.nan_to_num_().to(torch.uint8).view(-1)[:numel]
    minimum = None if symmetric else g.offset.view(-1).to(scale_dtype)
    return BlockQuantized(
        pack_int4(codes) if bits == 4 else codes, g.scale.view(-1).to(scale_dtype), minimum, numel, bits, block_size
    )


def dequantize_blocks(q: BlockQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor (`q.numel` elements) that `q` stands for, computed in the scale's dtype."""
    out = torch.empty(q.numel, dtype=q.scale.dtype, device=q.codes.device)
    return dequantize_blocks_into(q, out).to(dtype)


def dequantize_blocks_into(q: BlockQuantized, out: torch.Tensor) -> torch.Tensor:
    """`out.view(-1).copy_(dequantize_blocks(q, out.dtype))` without the temporaries: an `out` of the
    scale's dtype takes the codes, then the scale (and minimum) in place, block by block — three passes
    over `out` and no allocation of its size (what a gather of stored shards pays per token in
    ZeRO-Inference). Other dtypes go through one buffer of the scale's dtype decoded so, rounded once
    at the end."""
    flat = out.view(-1)
    if q.numel == 0:
        return flat
    if out.dtype != q.scale.dtype:
        return flat.copy_(dequantize_blocks_into(q, torch.empty(q.numel, dtype=q.scale.dtype, device=out.device)))
    flat.copy_(unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes)
    whole = q.numel // q.block_size
    tail = q.numel - whole * q.block_size
    parts = [(flat[: whole * q.block_size].view(whole, q.block_size), slice(0, whole))]
    if tail:
        parts.append((flat[whole * q.block_size :].view(1, tail), slice(whole, whole + 1)))
    shift = 2 ** (q.bits - 1) if q.symmetric else 0
    for v, rows in parts:
        decode_(v, q.scale[rows, None], None if q.minimum is None else q.minimum[rows, None], shift=shift)
    return flat


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (uint8, flat) two per byte: element 2i in the low nibble of byte i, 2i + 1 in
    the high one (an odd count leaves the last high nibble 0)."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    high = (flat[1::2] & 0xF).bitwise_left_shift_(4)
    return (flat[0::2] & 0xF).bitwise_or_(high)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` codes of `pack_int4`'s output (flat; `packed` of any shape, read in order)."""
    packed = packed.reshape(-1)
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8, device=packed.device)
    out[0::2], out[1::2] = packed & 0xF, packed >> 4
    return out[:numel]


def to_bytes(q: BlockQuantized) -> torch.Tensor:
    """One uint8 buffer of `q.nbytes`: scales, minimums (asymmetric), codes."""
    if q.scale.dtype != torch.float32:
        raise ValueError(
            f"to_bytes: the wire format carries fp32 scales, got {q.scale.dtype}; quantize with "
            "scale_dtype=torch.float32"
        )
    parts = [q.scale.contiguous().view(torch.uint8)]
    if q.minimum is not None:
        parts.append(q.minimum.contiguous().view(torch.uint8))
    parts.append(q.codes)
    return torch.cat(parts)


def from_bytes(buf: torch.Tensor, numel: int, bits: int, block_size: int, symmetric: bool = True) -> BlockQuantized:
    """Inverse of `to_bytes` (the buffer may be a view into a larger receive buffer)."""
    blocks = num_blocks(numel, block_size)
    s = blocks * SCALE_BYTES
    scale = buf[:s].clone().view(torch.float32)  # clone: the slice may not be 4-byte aligned
    minimum = None if symmetric else buf[s : 2 * s].clone().view(torch.float32)
    start = s if symmetric else 2 * s
    return BlockQuantized(buf[start : start + code_bytes(numel, bits)], scale, minimum, numel, bits, block_size)


def ds_quantizer(
    input: torch.Tensor, groups: int = 1, bit_num: int = 8, sr: bool = False, asym: bool = False
) -> torch.Tensor:
    """`input` rounded to `bit_num` bits per element with one scale per group (a new tensor)."""
    if groups < 1 or input.numel() % groups:
        raise ValueError(
            f"ds_quantizer: {input.numel()} elements cannot be cut into groups={groups} equal groups; "
            "pass a groups value dividing the element count"
        )
    q = quantize_blocks(
        input, bits=bit_num, block_size=max(1, input.numel() // groups), symmetric=not asym, stochastic=sr
    )
    return dequantize_blocks(q, input.dtype).view_as(input)
