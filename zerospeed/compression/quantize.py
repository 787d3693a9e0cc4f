"""Weight fake-quantization for QAT: integer codes, scales, the straight-through estimator and the
bit schedule. Pure functions of tensors and integers.

Note [quantizer formula]: DeepSpeed's compression quantizers divide the range by 2**bits (so the
largest magnitude is clamped one step short). Here the standard grids are used instead: symmetric
``scale = max|w| / (2**(bits-1) - 1)``, codes in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``;
asymmetric ``scale = (max - min) / (2**bits - 1)``, ``zero = round(-min / scale)``, codes in
``[0, 2**bits - 1]`` (the zero-point form of Note [block grids] in precision/quantize.py, which
computes them). Each of ``groups`` contiguous chunks of the flattened weight has its own
scale. The same codes are what ``redundancy_clean`` stores, so the stored model computes exactly
what the QAT forward computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zerospeed.precision.quantize import dequantize_grid, quantize_grid


class Codes(NamedTuple):
    """Integer codes ``(groups, n)`` (float dtype holding integers) with per-group scale and zero."""

    codes: torch.Tensor
    scale: torch.Tensor  # (groups, 1)
    zero: torch.Tensor  # (groups, 1); all zeros when symmetric


_TINY = torch.finfo(torch.float32).tiny  # the scale's floor (Note [zero scale] in precision/quantize.py)


def _grid(
    x_GN: torch.Tensor,
    bits: int,
    symmetric: bool,
    lo_G1: torch.Tensor | None = None,
    hi_G1: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Codes:
    """Codes of ``x_GN`` on the grid that spans each row's ``[min, max]``, or ``[lo, hi]`` when given (values
    outside are clamped): `precision.quantize`'s zero-point grid."""
    g = quantize_grid(
        x_GN,
        bits,
        symmetric,
        zero_point=True,
        lo_B1=lo_G1,
        hi_B1=hi_G1,
        min_scale=_TINY,
        stochastic=stochastic,
        generator=generator,
    )
    return Codes(g.codes, g.scale, torch.zeros_like(g.scale) if symmetric else g.offset)


def _ternary(x_GN: torch.Tensor) -> Codes:
    """Note [XTC ternary and binary]: ternary weights (XTC, arXiv 2206.01859, and DeepSpeed's
    TernaryQuantizer) keep per group the weights with ``|w| > 0.7 * mean|w|`` as ``sign(w) * alpha``,
    ``alpha`` the mean ``|w|`` of those kept, and set the rest to 0: codes -1 / 0 / +1, scale alpha.
    Binary weights are ``sign(w) * mean|w|``: codes -1 / +1 (a weight of exactly 0 counts as +1
    here, so there are always two values and one bit stores them; DeepSpeed's sign() makes it 0)."""
    thresh = 0.7 * x_GN.abs().mean(dim=1, keepdim=True)
    keep = x_GN.abs() > thresh
    alpha = (x_GN.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp_min(1)
    codes = torch.sign(x_GN) * keep
    scale = alpha.clamp_min(torch.finfo(torch.float32).tiny)
    return Codes(codes, scale, torch.zeros_like(scale))


def _binary(x_GN: torch.Tensor) -> Codes:
    """See Note [XTC ternary and binary]."""
    scale = x_GN.abs().mean(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.where(x_GN >= 0, 1.0, -1.0)
    return Codes(codes, scale, torch.zeros_like(scale))


def quantize_codes(
    w: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Codes:
    """The integer grid of ``w`` (see Note [quantizer formula]; 2 bits: ternary, 1 bit: binary, see
    Note [XTC ternary and binary])."""
    if w.numel() % groups:
        raise ValueError(f"quantize_groups={groups} does not divide the weight's {w.numel()} elements")
    x = w.detach().float().reshape(groups, -1)
    if bits <= 2:
        if not symmetric:
            raise ValueError(f"{'binary' if bits == 1 else 'ternary'} weights are symmetric only")
        return _ternary(x) if bits == 2 else _binary(x)
    return _grid(x, bits, symmetric, stochastic=stochastic, generator=generator)


def dequantize_codes(c: Codes, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values of the codes, reshaped to ``shape``."""
    return dequantize_grid(c.codes, c.scale, c.zero, zero_point=True).reshape(shape).to(dtype)


def fake_quantize(
    w: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``w`` rounded onto its ``bits``-bit grid, as a float tensor of ``w``'s shape and dtype (no grad)."""
    return dequantize_codes(quantize_codes(w, bits, groups, symmetric, stochastic, generator), w.shape, w.dtype)


def ste_quantize(
    w: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Fake-quantized ``w`` whose gradient is the identity (straight-through estimator).

    Every weight lies inside the grid's range (the scale comes from the weight's own extremes), so
    the clipped and the plain STE coincide; DeepSpeed's quantizers pass the gradient unchanged too.
    """
    return w + (fake_quantize(w, bits, groups, symmetric, stochastic, generator) - w).detach()


def bits_at_step(step: int, start_bits: int, target_bits: int, period: int) -> int:
    """Bits in use after ``step`` quantization steps (DeepSpeed MoQ's schedule).

    Note [bit schedule]: DeepSpeed drops one bit when the step count reaches the period and then
    doubles the period (``runtime/quantize.py``: ``start_bits -= 1; q_period <<= 1``), so drop k
    happens at step ``period * 2**(k-1)``: with period 10 and 8 -> 4 bits, 7 bits from step 10,
    6 from 20, 5 from 40, 4 from 80. Steps count from ``schedule_offset`` here (quantization is off
    before it), i.e. ``step = global_step - schedule_offset``.
    """
    if step < 0:
        return start_bits
    drops, at = 0, period
    while drops < start_bits - target_bits and at <= step:
        drops, at = drops + 1, at * 2
    return start_bits - drops


def activation_codes(
    x: torch.Tensor,
    bits: int,
    symmetric: bool = True,
    x_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    sample_wise: bool = False,
) -> Codes:
    """The codes of activation ``x`` as rows ``(tokens or samples, n)`` (Note [activation ranges])."""
    flat = x.detach().float().reshape(x.shape[0], -1) if sample_wise else x.detach().float().reshape(-1, x.shape[-1])
    if x_range is None:
        return _grid(flat, bits, symmetric)
    lo, hi = (t.detach().float().reshape(1, 1) for t in x_range)
    return _grid(flat, bits, symmetric, lo, hi)


def ste_quantize_activation(
    x: torch.Tensor,
    bits: int,
    symmetric: bool = True,
    x_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    sample_wise: bool = False,
) -> torch.Tensor:
    """Fake-quantized activation ``x`` with the identity gradient (straight-through).

    Note [activation ranges]: with ``x_range=None`` (DeepSpeed's ``range_calibration: "dynamic"``)
    every token, i.e. every vector along the last dimension, gets the grid of its own min and max
    (every sample, ``x[i]``, with ``sample_wise``: DeepSpeed's grouping for convolutions);
    with a ``(lo, hi)`` pair (``"static"``) the whole tensor shares that grid and values outside it
    are clamped. The grid itself is the weights' (Note [quantizer formula]).
    """
    c = activation_codes(x, bits, symmetric, x_range, sample_wise)
    return x + (dequantize_codes(c, x.shape, x.dtype) - x).detach()


class ActivationRange(torch.nn.Module):
    """The static range of DeepSpeed's ``QuantAct``: an exponential moving average of each training
    batch's min and max (the first batch sets it), frozen in eval mode. A buffer, so checkpoints
    carry it."""

    def __init__(self, momentum: float = 0.95):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("x_min_max", torch.zeros(2))
        self.register_buffer("seen", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        now = torch.stack([x.detach().min(), x.detach().max()]).float()
        if not bool(self.seen):
            self.x_min_max.copy_(now)
            self.seen.fill_(True)
        else:
            self.x_min_max.mul_(self.momentum).add_(now, alpha=1 - self.momentum)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training:
            self.update(x)
        return self.x_min_max[0], self.x_min_max[1]
