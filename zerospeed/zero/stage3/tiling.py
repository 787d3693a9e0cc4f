"""A linear layer cut into tiles, so that ZeRO stage 3 gathers one tile at a time (DeepSpeed's TiledLinear).

Note [tiles are units]: stage 3 gives every module that registers parameters its own unit, gathered
before that module's forward and backward and released after (stage3/strategy.py). A `TiledLinear`
registers none itself: each of its `in_splits x out_splits` tiles is an ordinary linear module, so
each tile is a unit, and a forward or backward through the layer holds one tile's weights gathered at
a time (plus whatever the prefetch and reuse budgets keep: `stage3_prefetch_bucket_size` and
`stage3_max_reuse_distance` bound that look-ahead, Note [stage-3 prefetch order]). Without stage 3
the layer is just a slower `nn.Linear` with the same values.

Tile (o, i) holds `weight[out_bounds[o]:out_bounds[o+1], in_bounds[i]:in_bounds[i+1]]` of the whole
layer; the last tile of each output row (i = in_splits - 1) holds that row's bias, so the sum over i
adds the bias once. Bounds follow DeepSpeed's `partition_uniform`: equal parts, the first
`features % splits` parts one larger. The parameter names (`linears.<o>.<i>.weight`) are DeepSpeed's,
so state dicts move between the two.
"""

from __future__ import annotations

import torch

from zerospeed.zero.stage3.api import GatheredParameters


def tile_bounds(features: int, splits: int) -> list[int]:
    """[0, b1, ..., features]: `splits` contiguous parts, the first `features % splits` one larger."""
    base, extra = divmod(features, splits)
    bounds = [0]
    for k in range(splits):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions, contiguous_split_chunks: bool = False):
    """`tensor` cut along its last dimension into pieces of the sizes in `partitions` (views, or
    contiguous copies with `contiguous_split_chunks`)."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class TiledLinear(torch.nn.Module):
    """A drop-in for `torch.nn.Linear(in_features, out_features, bias)` made of `in_splits x out_splits`
    tiles of `linear_cls` (Note [tiles are units]).

    `input_is_already_split`: `forward` receives a sequence of `in_splits` input pieces instead of one
    tensor. `combine_out_splits=False`: `forward` returns the list of `out_splits` output pieces instead of
    their concatenation. `init_linear`: a linear layer (weight `[out_features, in_features]`) whose values
    the tiles copy (`copy_params_from`). `kwargs` go to every `linear_cls(...)`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls=torch.nn.Linear,
        init_linear=None,
        **kwargs,
    ):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits={in_splits} must be in [1, in_features={in_features}]")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits={out_splits} must be in [1, out_features={out_features}]")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = tile_bounds(in_features, in_splits)
        self.out_parts = tile_bounds(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            rows = self.out_parts[o + 1] - self.out_parts[o]
            row = torch.nn.ModuleList()
            for i in range(in_splits):
                cols = self.in_parts[i + 1] - self.in_parts[i]
                row.append(linear_cls(cols, rows, bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(input_)} input pieces for in_splits={self.in_splits}")
            inputs = input_
        else:
            bounds = tile_bounds(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [b - a for a, b in zip(bounds, bounds[1:])])
        outputs = []
        for o in range(self.out_splits):
            out = None
            for i in range(self.in_splits):
                out = self._reduce_local_output(i, o, out, self.linears[o][i](inputs[i]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    # DeepSpeed's extension points: subclasses override these three for other input / output types
    def _split_global_input(self, input, split_sizes):
        """The input cut along its last dimension into pieces of `split_sizes`."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """The running sum over input tiles of output row `out_id` (None before its first tile)."""
        return new_out if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        """The output rows joined along the last dimension."""
        if len(outputs) != self.out_splits:
            raise ValueError(f"TiledLinear: {len(outputs)} output pieces for out_splits={self.out_splits}")
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy `other`'s weight (and bias) into the tiles. Under ZeRO stage 3 this is a collective (every
        rank calls it): `other` is gathered if it is partitioned, and rank 0's values become every rank's
        (`GatheredParameters(..., modifier_rank=0)`)."""
        with GatheredParameters([p for p in (other.weight, getattr(other, "bias", None)) if p is not None]):
            self._check_source(other)
            for o in range(self.out_splits):
                r0, r1 = self.out_parts[o], self.out_parts[o + 1]
                for i in range(self.in_splits):
                    c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                    tile = self.linears[o][i]
                    with GatheredParameters([p for p in (tile.weight, tile.bias) if p is not None], modifier_rank=0):
                        tile.weight.copy_(other.weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.copy_(other.bias[r0:r1])

    def _check_source(self, other) -> None:
        shape = (self.out_features, self.in_features)
        if tuple(other.weight.shape) != shape:
            raise ValueError(f"TiledLinear.copy_params_from: weight {tuple(other.weight.shape)}, expected {shape}")
        bias = getattr(other, "bias", None)
        if self.use_bias != (bias is not None):
            raise ValueError(
                f"TiledLinear.copy_params_from: bias={self.use_bias} here but the source has bias={bias is not None}"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"TiledLinear.copy_params_from: bias {tuple(bias.shape)}, expected ({self.out_features},)")


class TiledLinearReturnBias(TiledLinear):
    """A TiledLinear over tiles that return `(output, bias)` without adding the bias (Megatron-LM's
    `RowParallelLinear(skip_bias_add=True)` style): forward returns `(output, bias)`, the bias the
    concatenation of the rows' biases (None when no tile returns one)."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        old, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        return super()._reduce_local_output(in_id, out_id, old, tensor), old_bias if bias is None else bias

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, torch.cat(biases, dim=-1) if biases else None
