"""DS4Sci_EvoformerAttention (zerospeed/ops/evoformer.py) against a float64 naive reference: the logits
materialised, `torch.softmax`, as in DeepSpeed's own test. fp32 within 1e-5 relative; bf16 / fp16 within
DeepSpeed's test tolerances (max-abs 5e-2 / 1e-2 on O, dQ, dK, dV, twice that on the bias gradients) at
DeepSpeed's test shapes scaled down for the suite (the full shapes: benchmarks/evoformer_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.alloc_peak import AllocationTrace
from zerospeed.ops.deepspeed4science import DS4Sci_EvoformerAttention, EvoformerFusedAttention
from zerospeed.ops.evoformer import DEFAULT_BLOCK_ELEMENTS, MIN_QUERY_CHUNK, Chunks, evoformer_attention, plan_chunks


def naive(q, k, v, biases):
    """softmax(q k^T / sqrt(D) + biases) v with the [B, N, H, L, L] logits written out."""
    s = torch.einsum("bnqhd,bnkhd->bnhqk", q, k) / math.sqrt(q.shape[-1])
    for b in biases:
        if b is not None:
            s = s + b
    return torch.einsum("bnhqk,bnkhd->bnqhd", torch.softmax(s, -1), v)


def inputs(shape, dtype, masked=True, seed=0):
    """Q, K, V, bias1 (DeepSpeed's test mask: 1e9 * (mask - 1), -inf in fp16) and bias2, all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    B, N, L, H, D = shape
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.randint(0, 2, (B, N, 1, 1, L), generator=g).to(dtype) if masked else torch.ones(B, N, 1, 1, L)
    mask[..., 0] = 1  # every row keeps a key (fully masked rows: their own test)
    bias1 = (1e9 * (mask.to(dtype) - 1)).requires_grad_()
    bias2 = torch.randn(B, 1, H, L, L, generator=g).to(dtype).requires_grad_()
    return q, k, v, bias1, bias2


def run(fn, tensors, grad_out):
    """(output, grads of every tensor that requires grad) in float64."""
    out = fn(*tensors)
    needs = [t for t in tensors if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, needs, grad_out)
    return out.double(), [g.double() for g in grads]


def reference(q, k, v, bias1, bias2, grad_out):
    up = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v, bias1, bias2)]
    return run(lambda q, k, v, b1, b2: naive(q, k, v, [b1, b2]), up, grad_out.double())


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_plan_chunks_bounds_the_block_and_keeps_whole_rows_when_they_fit():
    assert plan_chunks(64, 1024, 1024) == Chunks(DEFAULT_BLOCK_ELEMENTS // (64 * 1024), 1024)  # whole key rows
    assert plan_chunks(4, 100, 100) == Chunks(100, 100)  # everything fits in one block
    # DeepSpeed's test shape (1, 256, 256, 4, 32): 16 whole rows would be 4M logits, so 16 queries x 64 keys
    assert plan_chunks(1024, 256, 256) == Chunks(MIN_QUERY_CHUNK, DEFAULT_BLOCK_ELEMENTS // (1024 * MIN_QUERY_CHUNK))
    rows, L = 4096, 4096  # one query over all keys is already 16M logits: keys chunked too
    c = plan_chunks(rows, L, L)
    assert c.queries == MIN_QUERY_CHUNK and c.queries * c.keys * rows <= DEFAULT_BLOCK_ELEMENTS
    assert plan_chunks(10**6, 3, 5, budget=1) == Chunks(3, 1)  # never below one key
    with pytest.raises(ValueError, match="budget"):
        plan_chunks(1, 1, 1, budget=0)


BIASES = {"none": (False, False), "bias1": (True, False), "bias2": (False, True), "both": (True, True)}


@pytest.mark.parametrize("which", list(BIASES))
@pytest.mark.parametrize("chunks", [None, Chunks(7, 11), Chunks(16, 37)], ids=["auto", "q7k11", "q16k37"])
def test_fp32_values_and_gradients_match_float64_naive(which, chunks):
    """L = 37 is a multiple of no chunk; Chunks(7, 11) runs the online softmax across key blocks."""
    q, k, v, bias1, bias2 = inputs((2, 3, 37, 4, 16), torch.float32)
    use1, use2 = BIASES[which]
    bias1, bias2 = bias1 if use1 else None, bias2 if use2 else None
    grad_out = torch.randn(q.shape)
    out, grads = run(
        lambda *t: DS4Sci_EvoformerAttention(*t[:3], [t[3], t[4]], chunks=chunks), (q, k, v, bias1, bias2), grad_out
    )
    ref_out, ref_grads = reference(q, k, v, bias1, bias2, grad_out)
    assert out.dtype == torch.float64 and rel(out, ref_out) <= 1e-5
    assert len(grads) == len(ref_grads) == 3 + use1 + use2
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= 1e-5


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 64, 128, 4, 32), (1, 128, 128, 8, 8)], ids=["D32", "D8"])
def test_low_precision_within_deepspeeds_tolerances(dtype, eps, shape):
    """DeepSpeed's test shapes (1, 256, 256, 4, 32) and (1, 512, 256, 8, 8) with N and L scaled down;
    fp16's mask is -inf (1e9 overflows), bf16's -1e9. dBias1 sums H x L terms per key (|dBias1| ~ 45 at
    the full shape, where one bf16 ulp is 0.25): its tolerance adds one ulp of the dtype, the rounding
    of the exact value itself (DeepSpeed's test gives the mask no gradient)."""
    q, k, v, bias1, bias2 = inputs(shape, dtype)
    assert (bias1 == -math.inf).any() == (dtype == torch.float16)
    grad_out = torch.rand(shape).to(dtype)
    out, grads = run(lambda *t: DS4Sci_EvoformerAttention(*t[:3], [t[3], t[4]]), (q, k, v, bias1, bias2), grad_out)
    ref_out, ref_grads = reference(q, k, v, bias1, bias2, grad_out)
    assert (out - ref_out).abs().max() < eps
    ulp = torch.finfo(dtype).eps  # one ulp, relative
    for name, g, r in zip(("dQ", "dK", "dV", "dBias1", "dBias2"), grads, ref_grads):
        if name.startswith("dB"):
            assert ((g - r).abs() <= 2 * eps + ulp * r.abs()).all(), name
        else:
            assert (g - r).abs().max() < eps, name
    assert all(t.grad is None for t in (q, k, v))  # (autograd.grad: nothing accumulated)


def test_fully_masked_rows_are_nan_as_in_deepspeeds_kernel_and_torch_softmax():
    """Note [fully masked rows]: an fp16 -inf mask over every key of a row gives NaN (the kernel's
    exp(-inf - (-inf))); the other rows stay exact, even one whose first key blocks are all masked."""
    shape = (1, 3, 20, 2, 8)
    q, k, v, _, bias2 = inputs(shape, torch.float32)
    mask = torch.ones(1, 3, 1, 1, 20)
    mask[0, 1] = 0  # row n = 1: every key masked
    mask[0, 2, ..., :12] = 0  # row n = 2: the first three key blocks of 4 masked
    bias1 = (1e9 * (mask.half() - 1)).float().requires_grad_()
    assert bias1[0, 1].isneginf().all()
    grad_out = torch.randn(shape)
    out, grads = run(
        lambda *t: DS4Sci_EvoformerAttention(*t[:3], [t[3], t[4]], chunks=Chunks(8, 4)),
        (q, k, v, bias1, bias2),
        grad_out,
    )
    ref_out, ref_grads = reference(q, k, v, bias1, bias2, grad_out)
    assert out[0, 1].isnan().all() and not out[0, [0, 2]].isnan().any()
    assert rel(out[0, [0, 2]], ref_out[0, [0, 2]]) <= 1e-5
    for g, r in zip(grads, ref_grads):  # NaN exactly where torch.softmax's backward puts it
        assert torch.equal(g.isnan(), r.isnan())
        finite = ~r.isnan()
        torch.testing.assert_close(g[finite], r[finite], rtol=1e-5, atol=1e-5)
    assert not grads[0][0, 2].isnan().any()


def test_saved_state_is_linear_in_l_and_the_peak_far_below_naive():
    """Note [evoformer chunks]: nothing autograd keeps has N x L^2 elements, and forward + backward
    allocate a fraction of what the naive form does (harness.alloc_peak, the torch allocator's record)."""
    shape = (1, 16, 256, 2, 8)
    q, k, v, bias1, bias2 = inputs(shape, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2])
    assert max(saved) == bias2.numel() < 16 * 2 * 256 * 256  # (the pair bias itself is [1, 1, H, L, L])

    def peak(fn):
        with AllocationTrace() as trace, trace.window("w"):
            out = fn()
            torch.autograd.grad(out, (q, k, v, bias1, bias2), torch.ones_like(out))
            del out
        return trace.peak("w") - trace.at_start("w")

    ours = peak(lambda: DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2], chunks=Chunks(8, 256)))
    theirs = peak(lambda: naive(q, k, v, [bias1, bias2]))
    assert ours * 4 < theirs, (ours, theirs)


@pytest.mark.parametrize("which", ["none", "bias1", "bias2"])
def test_the_fused_sdpa_path_is_exact_where_it_is_chosen(which):
    """Note [evoformer fused path], forced on the CPU (on CUDA "auto" picks it): one bias needing no
    gradient; fully masked rows NaN as in the chunked path."""
    shape = (1, 3, 24, 2, 8)
    q, k, v, bias1, bias2 = inputs(shape, torch.float32)
    bias1 = bias1.detach().clone()
    bias1[0, 2] = -math.inf
    bias1, bias2 = (bias1 if which == "bias1" else None), (bias2.detach() if which == "bias2" else None)
    grad_out = torch.randn(shape)
    out, grads = run(lambda *t: evoformer_attention(*t, backend="sdpa"), (q, k, v, bias1, bias2), grad_out)
    chunked = evoformer_attention(q, k, v, bias1, bias2, backend="chunked")
    assert torch.equal(out.isnan(), chunked.isnan()) and out[0, 2].isnan().all() == (which == "bias1")
    rows = [0, 1]
    ref_out, ref_grads = reference(q, k, v, bias1, bias2, grad_out)
    assert rel(out[0, rows], ref_out[0, rows]) <= 1e-5
    if which != "bias1":  # (with a fully masked row, the kernel's gradients differ: see the Note)
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) <= 1e-5


def test_the_fused_path_refuses_what_it_cannot_do_exactly():
    q, k, v, bias1, bias2 = inputs((2, 2, 16, 2, 8), torch.float32)
    for b1, b2 in ((bias1.detach(), bias2.detach()), (bias1, None), (None, bias2.detach())):  # B = 2 for bias2
        with pytest.raises(ValueError, match="backend='sdpa' is exact only"):
            evoformer_attention(q, k, v, b1, b2, backend="sdpa")
    with pytest.raises(ValueError, match="backend must be one of"):
        evoformer_attention(q, k, v, backend="flash")


def test_shape_errors_name_the_argument_and_the_expected_shape():
    q, k, v, bias1, bias2 = inputs((1, 2, 18, 2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"bias1 must have shape \[1, 2, 1, 1, 18\]"):
        DS4Sci_EvoformerAttention(q, k, v, [bias1[:, :, :, :, :-1]])
    with pytest.raises(ValueError, match=r"bias2 must have shape \[1, 1, 2, 18, 18\]"):
        DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2.transpose(-1, -2)[..., :-1]])
    with pytest.raises(ValueError, match="Q must be 5-D"):
        DS4Sci_EvoformerAttention(q[0], k[0], v[0], [])
    with pytest.raises(ValueError, match="K must be"):
        DS4Sci_EvoformerAttention(q, k[:, :1], v, [])
    with pytest.raises(ValueError, match="at most two"):
        DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2, bias2])
    with pytest.raises(TypeError, match="one floating dtype"):
        DS4Sci_EvoformerAttention(q, k.double(), v, [])


def test_deepspeeds_calling_conventions():
    """`biases` may be [], [bias1] or [None, bias2] and is not modified (DeepSpeed's appends Nones to it);
    `EvoformerFusedAttention.apply(q, k, v, bias1, bias2)` as DeepSpeed's autograd function; a bias that
    needs no gradient gets none, and any L (DeepSpeed's kernel wants L > 16) and D (<= 64 in its backward)."""
    q, k, v, bias1, bias2 = inputs((1, 2, 5, 2, 80), torch.float32)
    biases = [None, bias2]
    out = DS4Sci_EvoformerAttention(q, k, v, biases)
    assert biases == [None, bias2]
    torch.testing.assert_close(out, naive(q, k, v, [bias2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, []), naive(q, k, v, []), rtol=1e-5, atol=1e-5)
    out = EvoformerFusedAttention.apply(q, k, v, bias1.detach(), bias2)
    torch.testing.assert_close(out, naive(q, k, v, [bias1, bias2]), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert bias2.grad is not None and q.grad is not None and bias1.grad is None
