"""TiledLinear / TiledLinearReturnBias and the ZeRO-3 linear wrapper (zero/stage3/tiling.py, linear.py)
against plain PyTorch: `nn.Linear` / `F.linear` give the reference outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

from zerospeed.zero.stage3.linear import LinearFunctionForZeroStage3, LinearModuleForZeroStage3, zero3_linear_wrap
from zerospeed.zero.stage3.tiling import TiledLinear, TiledLinearReturnBias, split_tensor_along_last_dim, tile_bounds


def test_tile_bounds_are_deepspeeds_partition_uniform():
    # DeepSpeed's partition_uniform: equal parts, the first `n % k` one larger
    assert tile_bounds(10, 3) == [0, 4, 7, 10]
    assert tile_bounds(7, 7) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert tile_bounds(8, 2) == [0, 4, 8]
    assert tile_bounds(5, 1) == [0, 5]


def _pair(in_f, out_f, bias, in_splits, out_splits):
    torch.manual_seed(0)
    ref = torch.nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=ref)
    return ref, tiled


def _assembled(tiled, name):
    """The tiles' weights (or weight gradients) put back into one [out, in] matrix, and the bias."""
    rows = []
    for row in tiled.linears:
        rows.append(torch.cat([getattr(t.weight, name) if name else t.weight.detach() for t in row], dim=1))
    weight = torch.cat(rows, dim=0)
    biases = [row[-1].bias for row in tiled.linears]
    if biases[0] is None:
        return weight, None
    return weight, torch.cat([getattr(b, name) if name else b.detach() for b in biases])


@pytest.mark.parametrize(
    "in_f,out_f,bias,in_splits,out_splits",
    [(12, 8, True, 1, 1), (12, 8, True, 3, 2), (10, 7, True, 3, 3), (10, 7, False, 4, 2), (9, 5, True, 9, 5)],
)
def test_output_and_gradients_equal_nn_linear(in_f, out_f, bias, in_splits, out_splits):
    ref, tiled = _pair(in_f, out_f, bias, in_splits, out_splits)
    w, b = _assembled(tiled, None)
    assert torch.equal(w, ref.weight.detach()) and (b is None or torch.equal(b, ref.bias.detach()))
    # only the last tile of a row carries a bias: it is added once
    assert all(
        (t.bias is not None) == (bias and i == in_splits - 1) for row in tiled.linears for i, t in enumerate(row)
    )
    x = torch.randn(2, 3, in_f, generator=torch.Generator().manual_seed(1))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    gy = torch.randn(2, 3, out_f, generator=torch.Generator().manual_seed(2))
    yr, yt = ref(xr), tiled(xt)
    torch.testing.assert_close(yt, yr, rtol=0, atol=1e-6)
    (yr * gy).sum().backward()
    (yt * gy).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=0, atol=1e-6)
    gw, gb = _assembled(tiled, "grad")
    torch.testing.assert_close(gw, ref.weight.grad, rtol=0, atol=1e-6)
    if bias:
        torch.testing.assert_close(gb, ref.bias.grad, rtol=0, atol=1e-6)


def test_split_input_and_uncombined_output():
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 7)
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    tiled.copy_params_from(ref)
    x = torch.randn(4, 10)
    pieces = split_tensor_along_last_dim(x, [4, 3, 3], contiguous_split_chunks=True)
    assert all(p.is_contiguous() for p in pieces)
    outs = tiled(pieces)
    assert [o.shape[-1] for o in outs] == [4, 3]  # tile_bounds(7, 2)
    torch.testing.assert_close(torch.cat(outs, -1), ref(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="input pieces"):
        tiled(pieces[:2])


def test_parameter_names_are_deepspeeds():
    names = [n for n, _ in TiledLinear(6, 4, in_splits=2, out_splits=2).named_parameters()]
    assert names == ["linears.0.0.weight", "linears.0.1.weight", "linears.0.1.bias"] + [
        "linears.1.0.weight",
        "linears.1.1.weight",
        "linears.1.1.bias",
    ]


def test_bad_splits_and_sources():
    with pytest.raises(RuntimeError, match="in_splits"):
        TiledLinear(4, 4, in_splits=5)
    with pytest.raises(RuntimeError, match="out_splits"):
        TiledLinear(4, 4, out_splits=0)
    with pytest.raises(ValueError, match="weight"):
        TiledLinear(4, 3, in_splits=2).copy_params_from(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match="bias"):
        TiledLinear(4, 3, bias=False).copy_params_from(torch.nn.Linear(4, 3))


class _SkipBiasLinear(torch.nn.Linear):
    """Megatron-style: returns (x W^T, b) without adding b."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


def test_return_bias_variant():
    torch.manual_seed(0)
    ref = torch.nn.Linear(9, 6)
    tiled = TiledLinearReturnBias(9, 6, in_splits=2, out_splits=3, linear_cls=_SkipBiasLinear, init_linear=ref)
    x = torch.randn(5, 9)
    out, bias = tiled(x)
    torch.testing.assert_close(out, F.linear(x, ref.weight), rtol=0, atol=1e-6)
    torch.testing.assert_close(bias, ref.bias.detach(), rtol=0, atol=0)
    out, bias = TiledLinearReturnBias(9, 6, bias=False, in_splits=2, linear_cls=_SkipBiasLinear)(x)
    assert bias is None and out.shape == (5, 6)


# -- the ZeRO-3 linear wrapper (Note [the linear wrapper]) --------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (4, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_wrap_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(5, 7, generator=g)
    b = torch.randn(5, generator=g) if bias else None
    args_ref = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    args_new = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y_ref, y_new = F.linear(*args_ref), zero3_linear_wrap(*args_new)
    torch.testing.assert_close(y_new, y_ref, rtol=0, atol=1e-6)
    gy = torch.randn(y_ref.shape, generator=g)
    (y_ref * gy).sum().backward()
    (y_new * gy).sum().backward()
    for a, r in zip(args_new, args_ref):
        if r is not None:
            torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=1e-5)


def test_linear_wrap_under_torch_func():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 7, generator=g), torch.randn(5, 7, generator=g), torch.randn(5, generator=g)

    def loss(f):
        return lambda w_, x_: f(x_, w_, b).tanh().sum()

    per_sample_ref = vmap(grad(loss(F.linear)), in_dims=(None, 0))(w, x)
    per_sample_new = vmap(grad(loss(zero3_linear_wrap)), in_dims=(None, 0))(w, x)
    torch.testing.assert_close(per_sample_new, per_sample_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        jacrev(lambda x_: zero3_linear_wrap(x_, w, b))(x[0]), jacrev(lambda x_: F.linear(x_, w, b))(x[0])
    )
    torch.testing.assert_close(
        vmap(LinearFunctionForZeroStage3.apply, in_dims=(0, None, None))(x, w, b), F.linear(x, w, b)
    )


def test_linear_module_initialises_as_nn_linear():
    torch.manual_seed(3)
    ref = torch.nn.Linear(7, 5)
    torch.manual_seed(3)
    mod = LinearModuleForZeroStage3(7, 5)
    assert torch.equal(mod.weight, ref.weight) and torch.equal(mod.bias, ref.bias)
    x = torch.randn(3, 7)
    torch.testing.assert_close(mod(x), ref(x), rtol=0, atol=1e-6)
    assert LinearModuleForZeroStage3(7, 5, bias=False).bias is None
