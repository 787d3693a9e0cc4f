"""Block quantizers of ZeRO++ (zerospeed.precision.quantize): pure tensor math, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.precision.quantize import (
    dequantize_blocks,
    ds_quantizer,
    from_bytes,
    pack_int4,
    quantize_blocks,
    to_bytes,
    unpack_int4,
    wire_bytes,
)


def _per_element(values_per_block: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    return values_per_block.repeat_interleave(block)[:numel]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [1, 7, 64, 512])
def test_symmetric_round_trip_within_half_a_step(bits, block):
    x = torch.randn(3001, generator=torch.Generator().manual_seed(bits + block)) * 3
    q = quantize_blocks(x, bits, block, symmetric=True)
    err = (dequantize_blocks(q) - x).abs()
    absmax = torch.stack([x[i : i + block].abs().max() for i in range(0, 3001, block)])
    assert torch.allclose(q.scale, absmax / (2 ** (bits - 1) - 1))
    bound = _per_element(q.scale / 2, 3001, block)
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), (err - bound).max()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [5, 128])
def test_asymmetric_round_trip_within_half_a_step(bits, block):
    x = torch.rand(1000, generator=torch.Generator().manual_seed(bits * block)) * 5 + 2  # all positive
    q = quantize_blocks(x, bits, block, symmetric=False)
    err = (dequantize_blocks(q) - x).abs()
    spans = torch.stack([x[i : i + block].max() - x[i : i + block].min() for i in range(0, 1000, block)])
    bound = _per_element(spans / (2**bits - 1) / 2, 1000, block)
    assert bool((err <= bound * (1 + 1e-5) + 1e-6).all()), (err - bound).max()


def test_symmetric_int8_hand_computed():
    q = quantize_blocks(torch.tensor([1.0, -0.5, 0.25, 0.0]), bits=8, block_size=4)
    # scale = 1 / 127; codes = round(x * 127) + 128 (round half to even: -63.5 -> -64)
    assert q.scale.tolist() == pytest.approx([1 / 127])
    assert q.codes.tolist() == [255, 64, 160, 128]
    assert dequantize_blocks(q).tolist() == pytest.approx([1.0, -64 / 127, 32 / 127, 0.0])


def test_asymmetric_int4_hand_computed():
    q = quantize_blocks(torch.tensor([0.0, 1.0, 3.0, 10.0, 10.0]), bits=4, block_size=3, symmetric=False)
    # block 1: min 0, scale 3 / 15 = 0.2, codes 0, 5, 15; block 2: one value, scale 0, code 0
    assert q.scale.tolist() == pytest.approx([0.2, 0.0])
    assert q.minimum.tolist() == [0.0, 10.0]
    assert unpack_int4(q.codes, 5).tolist() == [0, 5, 15, 0, 0]
    assert q.codes.tolist() == [0 | 5 << 4, 15 | 0 << 4, 0]
    assert dequantize_blocks(q).tolist() == pytest.approx([0.0, 1.0, 3.0, 10.0, 10.0])


def test_symmetric_int4_packs_two_codes_per_byte():
    q = quantize_blocks(torch.tensor([0.7, -0.2]), bits=4, block_size=2)
    # scale 0.1; codes 7 + 8 = 15 (low nibble) and -2 + 8 = 6 (high nibble)
    assert q.codes.tolist() == [15 | 6 << 4]
    assert dequantize_blocks(q).tolist() == pytest.approx([0.7, -0.2])


@pytest.mark.parametrize("n", [1, 2, 15, 16, 33])
def test_int4_packing_is_lossless(n):
    codes = torch.arange(n, dtype=torch.uint8) % 16
    packed = pack_int4(codes)
    assert packed.numel() == math.ceil(n / 2)
    assert torch.equal(unpack_int4(packed, n), codes)


def test_every_int4_pair_round_trips():
    a = torch.arange(256, dtype=torch.uint8)
    codes = torch.stack([a & 0xF, a >> 4], 1).reshape(-1)
    assert torch.equal(pack_int4(codes), a)
    assert torch.equal(unpack_int4(a, 512), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    """Each element rounds down or up to a neighbouring level with the probability that keeps its
    expectation: the mean over K draws is within 5 standard errors of x. The variance of one draw is
    scale^2 f (1 - f) <= scale^2 / 4 (f the fraction of a step), so the standard error <= scale / (2 sqrt K)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    K = 2000
    draws = torch.stack(
        [dequantize_blocks(quantize_blocks(x, bits, 64, stochastic=True, generator=gen)) for _ in range(K)]
    )
    scale = _per_element(quantize_blocks(x, bits, 64).scale, 256, 64)
    assert bool(((draws - x).abs() < scale * (1 + 1e-5)).all())  # one step at most
    assert bool(((draws.mean(0) - x).abs() <= 5 * scale / (2 * math.sqrt(K))).all())
    # while rounding to nearest is biased for the elements between levels
    nearest = dequantize_blocks(quantize_blocks(x, bits, 64))
    assert (nearest - x).abs().max() > 10 * (scale / (2 * math.sqrt(K))).max()


@pytest.mark.parametrize("bits,symmetric", [(4, True), (8, True), (4, False), (8, False)])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_wire_format_round_trips_and_has_the_formula_size(bits, symmetric, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    q = quantize_blocks(x, bits, 256, symmetric=symmetric)
    buf = to_bytes(q)
    per_block = 4 if symmetric else 8
    assert buf.dtype == torch.uint8
    assert (
        buf.numel()
        == wire_bytes(n, bits, 256, symmetric)
        == (n if bits == 8 else math.ceil(n / 2)) + math.ceil(n / 256) * per_block
    )
    padded = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])[3:]  # an unaligned view
    back = from_bytes(padded, n, bits, 256, symmetric)
    assert torch.equal(dequantize_blocks(back), dequantize_blocks(q))


def test_zero_blocks_are_exact_and_non_finite_values_poison_their_block():
    x = torch.zeros(8)
    x[5] = float("nan")
    y = dequantize_blocks(quantize_blocks(x, 8, 4))
    assert y[:4].tolist() == [0.0] * 4
    assert bool(y[4:].isnan().all())


def test_empty_tensor_and_bad_settings():
    assert dequantize_blocks(quantize_blocks(torch.empty(0), 4, 8)).numel() == 0
    with pytest.raises(ValueError, match="bits = 4 or 8"):
        quantize_blocks(torch.ones(4), bits=2)
    with pytest.raises(ValueError, match="block_size"):
        quantize_blocks(torch.ones(4), block_size=0)


def test_ds_quantizer_fake_quantizes_by_groups():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    y = ds_quantizer(x, groups=4, bit_num=8)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max() <= x.abs().max() / 127 / 2 + 1e-7
    assert torch.equal(y, ds_quantizer(y, groups=4, bit_num=8))  # already on the grid
    with pytest.raises(ValueError, match="groups=3"):
        ds_quantizer(x, groups=3)


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False)])
@pytest.mark.parametrize("n", [24, 29])  # whole blocks of 8, and a short last block
def test_dequantize_into_a_buffer_is_the_block_formula(bits, symmetric, n):
    from zerospeed.precision.quantize import dequantize_blocks_into

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    q = quantize_blocks(x, bits, 8, symmetric)
    codes = (unpack_int4(q.codes, n) if bits == 4 else q.codes).float()
    want = torch.empty(n)
    for b in range(math.ceil(n / 8)):  # per block: x' = (code - 2^(bits-1)) s, or code s + min
        c = codes[8 * b : 8 * b + 8]
        want[8 * b : 8 * b + 8] = (c - 2 ** (bits - 1)) * q.scale[b] if symmetric else c * q.scale[b] + q.minimum[b]
    out = torch.full((n,), float("nan"))
    dequantize_blocks_into(q, out)
    assert torch.equal(out, want)
    half = torch.empty(n, dtype=torch.bfloat16)
    assert torch.equal(dequantize_blocks_into(q, half), want.to(torch.bfloat16))
