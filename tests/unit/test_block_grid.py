"""The one block quantizer (zerospeed.precision.quantize, Note [block grids]) in each of its forms and its
three users' settings, checked against the grid formulas written out element by element."""

from __future__ import annotations

import pytest
import torch

from zerospeed.compression.quantize import fake_quantize, quantize_codes
from zerospeed.compression.weight_quant.groupwise import dequantize, quantize
from zerospeed.precision.quantize import dequantize_grid, quantize_blocks, quantize_grid, to_bytes

TINY = torch.finfo(torch.float32).tiny


def _formula(row: list[float], bits: int, form: str, lo: float | None = None, hi: float | None = None):
    """Codes, scale, offset and values of one block by the formulas of the note (Python floats, fp32 rounding
    imitated by torch scalars where the implementation rounds)."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    lo = min(row) if lo is None else lo
    hi = max(row) if hi is None else hi
    if form == "symmetric":
        top = 2 ** (bits - 1) - 1
        scale = f(max(abs(lo), abs(hi))) / top
        step = scale if scale != 0 else f(1.0)
        codes = [min(max(torch.round(f(x) / step).item(), -top), top) for x in row]
        return codes, scale.item(), None, [(f(c) * scale).item() for c in codes]
    levels = 2**bits - 1
    scale = (f(hi) - f(lo)) / levels
    step = scale if scale != 0 else f(1.0)
    if form == "minimum":
        codes = [min(max(torch.round((f(x) - f(lo)) / step).item(), 0), levels) for x in row]
        return codes, scale.item(), lo, [(f(c) * scale + f(lo)).item() for c in codes]
    zero = torch.round(-f(lo) / step).item()
    codes = [min(max(torch.round(f(x) / step).item() + zero, 0), levels) for x in row]
    return codes, scale.item(), zero, [((f(c) - zero) * scale).item() for c in codes]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("form", ["symmetric", "minimum", "zero_point"])
def test_each_form_is_its_formula(bits, form):
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(bits)) * 3
    x[1] = 0.0  # a zero block: scale 0, exact
    x[2] = 2.5  # a constant block
    x[3, 4] = 0.0
    g = quantize_grid(x, bits, form == "symmetric", zero_point=form == "zero_point")
    values = dequantize_grid(g.codes, g.scale, g.offset, zero_point=form == "zero_point")
    for b in range(5):
        codes, scale, offset, want = _formula(x[b].tolist(), bits, form)
        assert g.codes[b].tolist() == codes and g.scale[b].item() == scale
        assert (g.offset is None) == (offset is None) and (offset is None or g.offset[b].item() == offset)
        if form != "zero_point" or b != 2:  # a constant non-zero block has no zero-point grid (the note)
            assert values[b].tolist() == want
    assert values[1].tolist() == [0.0] * 11
    if form == "zero_point":
        assert values[3, 4].item() == 0.0  # 0 is a level of the zero-point grid
    else:
        assert values[2].tolist() == [2.5] * 11


@pytest.mark.parametrize("form", ["symmetric", "minimum", "zero_point"])
def test_a_given_range_clamps(form):
    x = torch.tensor([[-3.0, -1.0, 0.0, 0.5, 2.0, 9.0]])
    lo, hi = torch.tensor([[-1.0]]), torch.tensor([[2.0]])
    g = quantize_grid(x, 8, form == "symmetric", zero_point=form == "zero_point", lo_B1=lo, hi_B1=hi)
    codes, scale, _, _ = _formula(x[0].tolist(), 8, form, -1.0, 2.0)
    assert g.codes[0].tolist() == codes and g.scale.item() == scale
    assert g.codes.min() >= (-127 if form == "symmetric" else 0) and g.codes.max() <= 255


def test_weight_groups_are_flat_blocks_with_scales_in_the_weight_dtype():
    """ZeRO-Inference's weight-only layers: (row, column-group) blocks, minimum form, bf16 scales and minimums
    rounded from the fp32 ones, codes from the fp32 scale; dequantization computes in bf16."""
    w = (torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    qw = quantize(w, 8, group_size=8)
    assert qw.data.shape == (3, 16) and qw.scale.shape == qw.minimum.shape == (3, 2)
    assert qw.scale.dtype == qw.minimum.dtype == torch.bfloat16
    want = torch.empty(3, 16, dtype=torch.bfloat16)
    for r in range(3):
        for gi in range(2):
            row = w[r, 8 * gi : 8 * gi + 8].float().tolist()
            codes, scale, lo, _ = _formula(row, 8, "minimum")
            assert qw.data[r, 8 * gi : 8 * gi + 8].tolist() == codes
            s, m = torch.tensor(scale).bfloat16(), torch.tensor(lo).bfloat16()
            assert qw.scale[r, gi] == s and qw.minimum[r, gi] == m
            want[r, 8 * gi : 8 * gi + 8] = torch.tensor(codes).bfloat16() * s + m
    assert torch.equal(dequantize(qw), want)


def test_weight_zero_group_keeps_a_floored_scale():
    qw = quantize(torch.zeros(2, 8), 8, group_size=4, symmetric=True)
    assert (qw.scale == TINY).all() and (dequantize(qw) == 0).all()
    q = quantize_blocks(torch.zeros(8), 8, 4)  # ZeRO++ stores the 0 itself
    assert (q.scale == 0).all()


def test_qat_codes_are_the_zero_point_grid_and_keep_zero_exact():
    w = torch.tensor([[-0.31, 0.0, 0.7, 1.9], [0.2, 0.4, 0.0, -2.0]])
    c = quantize_codes(w, 4, groups=2, symmetric=False)
    for b in range(2):
        codes, scale, zero, want = _formula(w[b].tolist(), 4, "zero_point")
        assert c.codes[b].tolist() == codes and c.scale[b].item() == scale and c.zero[b].item() == zero
        assert fake_quantize(w, 4, 2, symmetric=False)[b].tolist() == want
    y = fake_quantize(w, 4, 2, symmetric=False)
    assert y[0, 1].item() == 0.0 and y[1, 2].item() == 0.0  # exact zeros stay exact


def test_stochastic_grid_is_floor_of_value_plus_uniform_noise():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    g = quantize_grid(x, 8, True, stochastic=True, generator=torch.Generator().manual_seed(7))
    scale = x.abs().amax(1, keepdim=True) / 127
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(g.codes, torch.floor(x / scale + noise).clamp(-127, 127))


def test_wire_format_needs_fp32_scales():
    with pytest.raises(ValueError, match="fp32 scales"):
        to_bytes(quantize_blocks(torch.randn(16), 8, 8, scale_dtype=torch.float16))
