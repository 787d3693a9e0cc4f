"""`ds_quantizer`: DeepSpeed's fake quantization (quantize, then dequantize) of a tensor in `groups`
equal groups, with its argument names (`bit_num`, `sr` for stochastic rounding, `asym`)."""
from __future__ import annotations

import torch

from zerospeed.ops.quantizer.blockwise import dequantize_blocks, quantize_blocks


def ds_quantizer(input: torch.Tensor, groups: int = 1, bit_num: int = 8, sr: bool = False,
                 asym: bool = False) -> torch.Tensor:
    """`input` rounded to `bit_num` bits per element with one scale per group (a new tensor)."""
    if groups < 1 or input.numel() % groups:
        raise ValueError(f"ds_quantizer: {input.numel()} elements cannot be cut into groups={groups} equal groups; "
                         "pass a groups value dividing the element count")
    q = quantize_blocks(input, bits=bit_num, block_size=max(1, input.numel() // groups), symmetric=not asym,
                        stochastic=sr)
    return dequantize_blocks(q, input.dtype).view_as(input)
