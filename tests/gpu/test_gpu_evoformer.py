"""DS4Sci_EvoformerAttention on a GPU (docs/science.md): the chunked path at DeepSpeed's own test shapes and
tolerances in bf16 / fp16 (max-abs 5e-2 / 1e-2 on O, dQ, dK, dV; twice that, plus one ulp of the dtype, on
the bias gradients) against a float64 naive reference on the same GPU, and the fused SDPA path that
`backend="auto"` takes on CUDA (one bias that needs no gradient) against the chunked one. Not yet run on
a GPU: written while no device was lent (issue 47); the same checks pass on the CPU in
tests/unit/test_evoformer_attention.py."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _naive(q, k, v, biases):
    s = torch.einsum("bnqhd,bnkhd->bnhqk", q, k) / math.sqrt(q.shape[-1])
    for b in biases:
        if b is not None:
            s = s + b
    return torch.einsum("bnhqk,bnkhd->bnqhd", torch.softmax(s, -1), v)


def _inputs(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, N, L, H, D = shape
    q, k, v = (torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.randint(0, 2, (B, N, 1, 1, L), device="cuda", generator=g).to(dtype)
    mask[..., 0] = 1
    bias1 = (1e9 * (mask - 1)).requires_grad_()
    bias2 = torch.randn(B, 1, H, L, L, device="cuda", generator=g).to(dtype).requires_grad_()
    return q, k, v, bias1, bias2


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 256, 256, 4, 32), (1, 512, 256, 8, 8)], ids=["D32", "D8"])
def test_chunked_path_at_deepspeeds_shapes(dtype, eps, shape):
    from zerospeed.ops.deepspeed4science import DS4Sci_EvoformerAttention

    q, k, v, bias1, bias2 = _inputs(shape, dtype)
    grad_out = torch.rand(shape, device="cuda").to(dtype)
    out = DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2])
    grads = torch.autograd.grad(out, (q, k, v, bias1, bias2), grad_out)
    up = [t.detach().double().requires_grad_() for t in (q, k, v, bias1, bias2)]
    ref = _naive(*up[:3], up[3:])
    ref_grads = torch.autograd.grad(ref, up, grad_out.double())
    assert (out.double() - ref).abs().max() < eps
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if i < 3:
            assert (g.double() - r).abs().max() < eps, i
        else:
            assert ((g.double() - r).abs() <= 2 * eps + torch.finfo(dtype).eps * r.abs()).all(), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_takes_the_fused_path_for_one_bias_without_gradient(dtype):
    from zerospeed.ops.evoformer import evoformer_attention

    q, k, v, bias1, _ = _inputs((1, 64, 128, 4, 32), dtype)
    bias1 = bias1.detach()
    fused = evoformer_attention(q, k, v, bias1)
    chunked = evoformer_attention(q, k, v, bias1, backend="chunked")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, chunked, rtol=tol, atol=tol)
