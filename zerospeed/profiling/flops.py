"""FLOP and MAC counting rules per torch function, as pure functions of shapes.

Conventions (what the tests check): a multiply-accumulate (MAC) is 2 FLOPs; a bias add, an
elementwise arithmetic op and an activation cost 1 FLOP per output element; a norm costs 5 FLOPs per
element with an affine transform (mean, subtract, variance, divide, scale+shift) and 4 without;
softmax / log_softmax / cross-entropy cost 1 per input element; an embedding lookup costs 0.
Scaled-dot-product attention counts both matmuls in full (a causal mask is not credited) plus the
softmax. Every rule returns (flops, macs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Counts = tuple[int, int]


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def linear_counts(args, kwargs, out) -> Counts:
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    macs = _numel(x) // weight.shape[-1] * weight.shape[0] * weight.shape[-1] if weight.dim() == 2 else 0
    return 2 * macs + (_numel(out) if bias is not None else 0), macs


def matmul_counts(args, kwargs, out) -> Counts:
    # (.., m, k) @ (.., k, n) -> (.., m, n): one MAC per output element per k.
    k = args[0].shape[-1] if args[0].dim() > 0 else 1
    macs = _numel(out) * k
    return 2 * macs, macs


def addmm_counts(args, kwargs, out) -> Counts:
    # addmm(bias, a, b) / baddbmm: the matmul plus one add per output element.
    k = args[1].shape[-1]
    macs = _numel(out) * k
    return 2 * macs + _numel(out), macs


def einsum_counts(args, kwargs, out) -> Counts:
    """One MAC per point of the iteration space (every distinct index), for two or more operands."""
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(operands) < 2 or any("." in term for term in inputs):
        return _numel(out), 0  # a reduction/permutation of one operand, or ellipsis: count the output
    sizes: dict[str, int] = {}
    for term, t in zip(inputs, operands):
        sizes.update(zip(term, t.shape))
    macs = math.prod(sizes.values()) * (len(operands) - 1)
    return 2 * macs, macs


def conv_counts(args, kwargs, out) -> Counts:
    # weight (C_out, C_in/groups, *k): every output element needs C_in/groups * prod(k) MACs.
    weight = args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    macs = _numel(out) * (weight.numel() // weight.shape[0])
    return 2 * macs + (_numel(out) if bias is not None else 0), macs


def conv_transpose_counts(args, kwargs, out) -> Counts:
    # weight (C_in, C_out/groups, *k): every input element scatters into C_out/groups * prod(k) outputs.
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    macs = _numel(x) * (weight.numel() // weight.shape[0])
    return 2 * macs + (_numel(out) if bias is not None else 0), macs


def sdpa_counts(args, kwargs, out) -> Counts:
    # q (.., L, E) k (.., S, E) v (.., S, Ev): q k^T is L*S*E MACs, (scores) v is L*S*Ev, softmax L*S.
    q, k, v = args[0], args[1], args[2]
    batch = _numel(q) // (q.shape[-2] * q.shape[-1])
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    macs = batch * L * S * (E + Ev)
    return 2 * macs + batch * L * S, macs


def norm_rule(weight_position: int) -> Callable[..., Counts]:
    """Norms: 5 FLOPs per element with an affine weight, 4 without; `weight_position` is its argument index."""

    def rule(args, kwargs, out) -> Counts:
        weight = kwargs.get("weight", args[weight_position] if len(args) > weight_position else None)
        return _numel(args[0]) * (5 if weight is not None else 4), 0

    return rule


def per_output(args, kwargs, out) -> Counts:
    return _numel(out if isinstance(out, torch.Tensor) else args[0]), 0


def per_input(args, kwargs, out) -> Counts:
    return _numel(args[0]), 0


def zero(args, kwargs, out) -> Counts:
    return 0, 0


_ELEMENTWISE = (
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "rsub",
    "pow",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "neg",
    "abs",
    "clamp",
    "square",
    "reciprocal",
)
_ACTIVATIONS = (
    "relu",
    "relu_",
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "leaky_relu",
    "elu",
    "selu",
    "softplus",
    "hardswish",
    "hardsigmoid",
    "mish",
    "relu6",
    "glu",
    "prelu",
)

RULES: dict[str, Callable[..., Counts]] = {
    "linear": linear_counts,
    "matmul": matmul_counts,
    "mm": matmul_counts,
    "bmm": matmul_counts,
    "__matmul__": matmul_counts,
    "__rmatmul__": matmul_counts,
    "addmm": addmm_counts,
    "baddbmm": addmm_counts,
    "einsum": einsum_counts,
    "conv1d": conv_counts,
    "conv2d": conv_counts,
    "conv3d": conv_counts,
    "conv_transpose1d": conv_transpose_counts,
    "conv_transpose2d": conv_transpose_counts,
    "conv_transpose3d": conv_transpose_counts,
    "scaled_dot_product_attention": sdpa_counts,
    # layer_norm(x, shape, weight), group_norm(x, groups, weight), batch_norm(x, mean, var, weight), ...
    "layer_norm": norm_rule(2),
    "group_norm": norm_rule(2),
    "rms_norm": norm_rule(2),
    "batch_norm": norm_rule(3),
    "instance_norm": norm_rule(3),
    "softmax": per_input,
    "log_softmax": per_input,
    "cross_entropy": per_input,
    "embedding": zero,
    "dropout": zero,
}
for _name in _ELEMENTWISE:
    for _variant in (_name, _name + "_", f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        RULES[_variant] = per_output
RULES["__truediv__"] = RULES["__rtruediv__"] = RULES["__itruediv__"] = per_output
for _name in _ACTIVATIONS:
    RULES[_name] = per_output


def count(name: str, args: tuple, kwargs: dict, out: Any) -> Counts | None:
    """(flops, macs) of one call of the torch function `name`, or None when it is not a counted op."""
    rule = RULES.get(name)
    if rule is None:
        return None
    return rule(args, kwargs, out)
