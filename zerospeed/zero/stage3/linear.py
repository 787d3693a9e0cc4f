"""DeepSpeed's ZeRO-3 linear wrapper: a linear autograd function that saves the weight *parameter* for
backward, not the gathered tensor.

Note [the linear wrapper]: in DeepSpeed, a stage-3 parameter is released by pointing it at an empty
tensor, so a stock `F.linear`, which saves a view of the gathered weight, keeps the whole gathered
storage alive until that layer's backward. DeepSpeed therefore replaces `torch.nn.functional.linear`
with `zero3_linear_wrap` (`zero_optimization.memory_efficient_linear`, default true; since 0.19 also
for a model given to `initialize` without `zero.Init`), whose function saves the parameter and
re-gathers it in backward when it finds it partitioned. zerospeed needs no replacement: a released
unit frees its storage in place, so the view a stock linear saved costs nothing until the backward
pre-hook re-gathers into that same storage (Note [freed in place], flat_param.py). zerospeed never
patches `torch.nn.functional.linear`; the names below exist for code that uses them directly, and
behave as DeepSpeed's: `zero3_linear_wrap(input, weight, bias)` equals `F.linear`, including under
`torch.func` transforms (`setup_context` + `generate_vmap_rule`), autocast, and with a weight that is
partitioned when its backward runs (it is gathered for the backward and released again).
"""

from __future__ import annotations

import math

import torch

from zerospeed.zero import tags
from zerospeed.zero.stage3.api import GatheredParameters
from zerospeed.zero.stage3.flat_param import State


def _linear(input, weight, bias):
    # not F.linear: code that installs zero3_linear_wrap as F.linear (DeepSpeed's way) would recurse
    out = input.matmul(weight.t())
    return out + bias if bias is not None else out


def _partitioned(weight: torch.Tensor) -> bool:
    owner = tags.owner_of(weight)
    return owner is not None and owner.state is State.SHARDED


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """y = x W^T + b, saving (x, W, b) — the parameter W itself — for backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        return _linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        device = input.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        enabled, dtype, device = ctx.autocast
        gathered = [weight] if _partitioned(weight) else []  # used outside its owner's hooks
        with GatheredParameters(gathered), torch.autocast(device, dtype=dtype, enabled=enabled):
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                g2, x2 = grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1])
                grad_weight = g2.t().matmul(x2)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    """`torch.nn.functional.linear(input, weight, bias)` through `LinearFunctionForZeroStage3`."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Module):
    """A linear layer (`nn.Linear`'s parameters and initialisation) whose forward is `zero3_linear_wrap`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As `nn.Linear.reset_parameters` (the same random draws, in the same order)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
