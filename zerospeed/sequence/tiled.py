"""ALST's tiled compute (arXiv 2506.13996): run a per-token function over tiles of the sequence so its
large intermediates (the MLP's [tokens, 4h], the logits' [tokens, vocab]) exist one tile at a time.

Note [tiled compute]: the forward runs each tile without recording a graph and keeps only the input;
the backward recomputes one tile at a time with a graph, takes the gradients of that tile's input and of
the parameters with `torch.autograd.grad` (which accumulates nothing into `.grad`), sums the parameter
gradients over the tiles, and returns them as the gradients of the parameters — passed as inputs of the
autograd function — so each parameter's `.grad` is written once per backward, as the ZeRO gradient
hooks expect (DeepSpeed instead lets every tile accumulate and marks parameters ready by hand).

Note [tiled compute under ZeRO-3]: stage 3 gathers a unit's parameters in its module's forward and
backward pre-hooks and empties them after. A tiled block is made one ZeRO-3 leaf unit
(`enable_tiled_mlp` flags it; Note [leaf modules] in zero/stage3/strategy.py), so its hooks sit on the
block itself: the forward pre-hook gathers every parameter of the block before the tiles run, the
modules inside run no hooks of their own (so the per-tile calls gather nothing more), and the backward
pre-hook gathers the block again before the recomputing backward above runs — the parameters it
saved are the module's own, which then point at the gathered values again. Their gradients come out
once, summed over the tiles, into the reduction as any unit's. The tiled loss uses the output head's
weight outside the head's forward (in the model's own); the model declares that use with
`zero.register_external_parameter(model, head.weight)`, as DeepSpeed asks of any parameter used outside
its module, and then the model's forward and backward pre-hooks gather the head's unit around the tiles
and their recomputation. An undeclared head weight is gathered when the model's forward reads it (Note
[undeclared external parameters], zero/stage3/external.py). A parameter still empty when the tiles run
(a block not flagged before `initialize`) is refused with an error naming both fixes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _check_full(params) -> None:
    for p in params:
        if p.numel() == 0:
            raise NotImplementedError(
                "tiled compute got a parameter with no elements — a ZeRO-3 shard used outside "
                "its module's forward: for a tiled MLP call enable_tiled_mlp before "
                "zerospeed.initialize (it makes each tiled block one ZeRO-3 leaf unit); for "
                "tiled_cross_entropy_sum's head weight declare the use with "
                "zerospeed.zero.register_external_parameter(model, head.weight) on the module "
                "whose forward calls the loss"
            )


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, shards, extras, x, *params):
        ctx.fn, ctx.shards, ctx.extras = fn, shards, extras
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return torch.cat([fn(t, *e) for t, e in zip(x.chunk(shards, dim=0), _tiles(extras, shards))], dim=0)

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        trainable = [p for p in params if p.requires_grad]
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        dparams = [torch.zeros_like(p) for p in trainable]
        start = 0
        for t, g, e in zip(x.chunk(ctx.shards, dim=0), grad.chunk(ctx.shards, dim=0), _tiles(ctx.extras, ctx.shards)):
            t = t.detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                out = ctx.fn(t, *e)
            wrt = ([t] if dx is not None else []) + trainable
            grads = torch.autograd.grad(out, wrt, g, allow_unused=True)
            if dx is not None:
                dx[start : start + t.shape[0]] = grads[0]
                grads = grads[1:]
            for acc, gp in zip(dparams, grads):
                if gp is not None:
                    acc += gp
            start += t.shape[0]
        it = iter(dparams)
        return (None, None, None, dx, *[next(it) if p.requires_grad else None for p in params])


def _tiles(extras: tuple[torch.Tensor, ...], shards: int):
    """Per tile, the matching tiles of the non-differentiated `extras` (labels, masks)."""
    if not extras:
        return [()] * shards
    return list(zip(*(e.chunk(shards, dim=0) for e in extras)))


def tiled_map(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    shards: int,
    params: list[torch.Tensor],
    extras: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """`fn(x_tile, *extra_tiles)` over `shards` tiles of `x` (tokens on dim 0), concatenated (Note [tiled
    compute]); `params` are the parameters `fn` uses (their gradients come out summed over the tiles),
    `extras` tensors tiled alongside `x` without gradients."""
    params = list(params)
    _check_full(params)
    if shards <= 1 or not torch.is_grad_enabled():
        return fn(x, *extras)
    return _Tiled.apply(fn, shards, tuple(extras), x, *params)


def tiled_mlp(mlp: torch.nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
    """`mlp(x)` for `x` [..., h], computed over `shards` tiles of the flattened tokens."""
    flat = x.reshape(-1, x.shape[-1])
    out = tiled_map(mlp, flat, shards, [p for p in mlp.parameters()])
    return out.view(*x.shape[:-1], out.shape[-1])


class TiledMLP:
    """DeepSpeed's `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x)` over tiles."""

    @staticmethod
    def apply(fn, self, x: torch.Tensor, shards: int, compute_params) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = tiled_map(lambda t: fn(self, t), flat, shards, list(compute_params or self.parameters()))
        return out.view(*x.shape[:-1], out.shape[-1])


def tiled_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, shards: int, ignore_index: int = -100
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, shift_labels) (fp32) without the full
    [tokens, vocab] logits: `shards` tiles of tokens at a time, in the backward too."""
    h = hidden.reshape(-1, hidden.shape[-1])

    def tile_loss(t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (t @ weight.t()).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")

    return tiled_map(tile_loss, h, shards, [weight], (shift_labels.reshape(-1).to(h.device),)).sum()
