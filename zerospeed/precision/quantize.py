"""Block quantization of flat tensors to int8 / int4: pure tensor math, no processes, no modules.

A flat tensor of `numel` elements is cut into consecutive blocks of `block_size` elements (the last
block may be shorter); each block gets its own fp32 scale (and, asymmetric, its own minimum), so an
outlier costs precision only within its block.

- symmetric: scale = absmax / (2^(bits-1) - 1), q = round(x / scale) in [-(2^(bits-1) - 1), 2^(bits-1) - 1],
  stored as the unsigned code q + 2^(bits-1); x' = (code - 2^(bits-1)) * scale.
- asymmetric: scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) in [0, 2^bits - 1];
  x' = code * scale + min.

Rounding to nearest errs by at most scale / 2 per element (half a step). Stochastic rounding rounds
v = x / scale down or up with probability 1 - frac(v) / frac(v), so E[x'] = x and |x - x'| < scale.

A block of zeros (or of one repeated value, asymmetric) has scale 0 and dequantizes exactly.
Non-finite inputs make their block's scale non-finite, so the whole block dequantizes to NaN/inf:
an fp16 overflow check downstream still sees it.

int4 codes are packed two to a byte (even element in the low nibble). On the wire
(`to_bytes`) a quantized tensor is one uint8 buffer: the fp32 scales, the fp32 minimums
(asymmetric only), then the codes — `wire_bytes` gives its length from integers alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # scales (and minimums) travel as fp32


@dataclass(frozen=True)
class BlockQuantized:
    codes: torch.Tensor  # uint8: numel codes (8-bit) or ceil(numel / 2) bytes of two codes (4-bit)
    scale: torch.Tensor  # fp32 [blocks]
    minimum: torch.Tensor | None  # fp32 [blocks], asymmetric only
    numel: int
    bits: int
    block_size: int

    @property
    def symmetric(self) -> bool:
        return self.minimum is None

    @property
    def nbytes(self) -> int:
        return wire_bytes(self.numel, self.bits, self.block_size, self.symmetric)


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


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x as [blocks, block_size] fp32, the last block padded by repeating its first element (so the
    padding never widens the block's range)."""
    flat = x.detach().reshape(-1).float()
    n, blocks = flat.numel(), num_blocks(flat.numel(), block_size)
    pad = blocks * block_size - n
    if pad:
        flat = torch.cat([flat, flat[(blocks - 1) * block_size].expand(pad)])
    return flat.view(blocks, block_size)


def _round(v: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    if not stochastic:
        return torch.round(v)
    noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
    return torch.floor(v + noise)


def quantize_blocks(x: torch.Tensor, bits: int = 8, block_size: int = 512, symmetric: bool = True,
                    stochastic: bool = False, generator: torch.Generator | None = None) -> BlockQuantized:
    """Quantize the flattened `x` block by block (module docstring)."""
    _check(bits, block_size)
    numel = x.numel()
    if numel == 0:
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return BlockQuantized(torch.empty(0, dtype=torch.uint8, device=x.device), empty,
                              None if symmetric else empty, 0, bits, block_size)
    w = _blocks(x, block_size)
    if symmetric:
        half = 2 ** (bits - 1)
        scale = w.abs().amax(1) / (half - 1)
        shifted = w / torch.where(scale == 0, 1.0, scale)[:, None]
        codes = _round(shifted, stochastic, generator).clamp(1 - half, half - 1) + half
        minimum = None
    else:
        levels = 2 ** bits - 1
        minimum = w.amin(1)
        scale = (w.amax(1) - minimum) / levels
        shifted = (w - minimum[:, None]) / torch.where(scale == 0, 1.0, scale)[:, None]
        codes = _round(shifted, stochastic, generator).clamp(0, levels)
    codes = torch.nan_to_num(codes).to(torch.uint8).reshape(-1)[:numel]
    return BlockQuantized(pack_int4(codes) if bits == 4 else codes, scale, minimum, numel, bits, block_size)


def dequantize_blocks(q: BlockQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor (`q.numel` elements) that `q` stands for."""
    if q.numel == 0:
        return torch.empty(0, dtype=dtype, device=q.codes.device)
    codes = unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes
    blocks = num_blocks(q.numel, q.block_size)
    v = torch.empty(blocks * q.block_size, dtype=torch.float32, device=codes.device)
    v[:q.numel] = codes
    v[q.numel:] = 0
    v = v.view(blocks, q.block_size)
    if q.symmetric:
        out = (v - 2 ** (q.bits - 1)) * q.scale[:, None]
    else:
        out = v * q.scale[:, None] + q.minimum[:, None]
    return out.reshape(-1)[:q.numel].to(dtype)


def dequantize_blocks_into(q: BlockQuantized, out: torch.Tensor) -> torch.Tensor:
    """`out.view(-1).copy_(dequantize_blocks(q, out.dtype))` without the temporaries: an fp32 `out` takes
    the codes, then the scale (and minimum) in place, block by block — the same operations in the same
    order, so the result is bit-identical — in three passes over `out` instead of six and no
    allocation of its size (what a gather of stored shards pays per token in ZeRO-Inference). Other
    dtypes go through one fp32 buffer decoded so, rounded once at the end as `dequantize_blocks`
    does (four passes instead of six)."""
    flat = out.view(-1)
    if q.numel == 0:
        return flat
    if out.dtype != torch.float32:
        return flat.copy_(dequantize_blocks_into(q, torch.empty(q.numel, dtype=torch.float32, device=out.device)))
    flat.copy_(unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes)
    whole = q.numel // q.block_size
    tail = q.numel - whole * q.block_size
    parts = [(flat[:whole * q.block_size].view(whole, q.block_size), slice(0, whole))]
    if tail:
        parts.append((flat[whole * q.block_size:].view(1, tail), slice(whole, whole + 1)))
    for v, rows in parts:
        if q.symmetric:
            v.sub_(2 ** (q.bits - 1)).mul_(q.scale[rows, None])
        else:
            v.mul_(q.scale[rows, None]).add_(q.minimum[rows, None])
    return flat


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (uint8, flat) two per byte: element 2i in the low nibble of byte i, 2i + 1 in
    the high one (an odd count leaves the last high nibble 0)."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] & 0xF) | ((flat[1::2] & 0xF) << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` codes of `pack_int4`'s output."""
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8, device=packed.device)
    out[0::2], out[1::2] = packed & 0xF, packed >> 4
    return out[:numel]


def to_bytes(q: BlockQuantized) -> torch.Tensor:
    """One uint8 buffer of `q.nbytes`: scales, minimums (asymmetric), codes."""
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
    minimum = None if symmetric else buf[s:2 * s].clone().view(torch.float32)
    start = s if symmetric else 2 * s
    return BlockQuantized(buf[start:start + code_bytes(numel, bits)], scale, minimum, numel, bits, block_size)


def max_rounding_error(q: BlockQuantized) -> torch.Tensor:
    """Per block, the largest error rounding to nearest can make: half a quantization step."""
    return q.scale / 2


def ds_quantizer(input: torch.Tensor, groups: int = 1, bit_num: int = 8, sr: bool = False,
                 asym: bool = False) -> torch.Tensor:
    """`input` rounded to `bit_num` bits per element with one scale per group (a new tensor)."""
    if groups < 1 or input.numel() % groups:
        raise ValueError(f"ds_quantizer: {input.numel()} elements cannot be cut into groups={groups} equal groups; "
                         "pass a groups value dividing the element count")
    q = quantize_blocks(input, bits=bit_num, block_size=max(1, input.numel() // groups), symmetric=not asym,
                        stochastic=sr)
    return dequantize_blocks(q, input.dtype).view_as(input)
