"""Inference on one GPU: `init_inference` (tp = 1) and ZeRO-Inference with the parameters in pinned host
memory or in swap files generate exactly what transformers' own `generate` does on the same GPU (fp32, TF32
off, a left-padded batch), and ZeRO-Inference keeps no weight on the device between forwards."""

import inference_cases as ic
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(200)
def test_generation_on_the_gpu_equals_transformers(tmp_path):
    (r,) = run_distributed(ic.served_ranks, 1, str(tmp_path), timeout=170, backend="nccl")
    for name in ("tp1", "zero_cpu", "zero_nvme"):
        got = r[name]
        assert torch.equal(got["tokens"], r["want"]), f"{name}:\n{got['tokens']}\n!=\n{r['want']}"
        torch.testing.assert_close(got["logits"], r["want_logits"], rtol=0, atol=1e-5, msg=name)
        assert got["logits_device"] == "cuda", name
    assert r["tp1"]["param_devices"] == ["cuda"]
    for name in ("zero_cpu", "zero_nvme"):  # between forwards every parameter is empty: the shards live off-GPU
        assert r[name]["resident"] == 0, (name, r[name]["resident"])
    assert r["zero_cpu"]["shards"] == [("cpu", True)], r["zero_cpu"]["shards"]  # pinned host shards


@pytest.mark.timeout(240)
def test_sparse_attention_flex_and_gather_kernels_on_the_gpu_equal_dense_attention():
    """Note [flex path]: on CUDA `kernel="auto"` is compiled flex_attention, forward and backward."""
    (r,) = run_distributed(ic.sparse_attention_ranks, 1, timeout=210, backend="nccl")
    for (name, kernel), errors in r.items():
        # fp32 with TF32 off: rounding of 1024-long sums, far under TF32's ~3e-4 (errors: out, dq, dk, dv)
        assert max(errors) <= 2e-5, (name, kernel, errors)


@pytest.mark.timeout(200)
def test_paged_server_on_the_gpu_equals_transformers_per_request():
    """Continuous batching with the KV cache in device memory: each request's tokens are `generate`'s."""
    (r,) = run_distributed(ic.paged_ranks, 1, timeout=170, backend="nccl")
    assert r["cache_device"] == "cuda"
    for i, (got, streamed, want) in enumerate(zip(r["got"], r["streamed"], r["want"])):
        assert got == want and streamed == want, f"request {i}"
    assert r["waste"] < 0.04, f"KV block waste {r['waste']:.2%}"
