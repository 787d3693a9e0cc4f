"""zero.Init on CUDA: a model built on the host is sharded onto the GPU (or kept in pinned host memory
with remote_device="cpu"), is exactly the eager model, and trains like it (one rank, or two on NCCL)."""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(200)
def test_zero_init_shards_on_the_gpu_and_builds_the_eager_model():
    world = min(2, gc.gpus())
    for r in run_distributed(gc.zero_init_ranks, world, timeout=170, backend="nccl"):
        # the shards live on the GPU the rank trains on; remote_device="cpu" keeps them in pinned host memory
        assert r["device"]["shards"] == [("cuda", False)], r["device"]
        assert r["host"]["shards"] == [("cpu", True)], r["host"]
        for name in ("device", "host"):
            # gathered on the GPU (device all-gathers), equal to the eager model bit for bit
            assert r[name]["full_devices"] == ["cuda"] and r[name]["same"], (name, r[name])
            # the replayed _init_weights drew from the host generator, as the eager construction did
            assert torch.equal(r[name]["host_rng_after"], r["eager_rng_after"]), name
        assert torch.equal(r["modified"], torch.full((16,), 7.0))  # broadcast from the last rank, on device
        torch.testing.assert_close(r["train_init"], r["train_eager"], rtol=0, atol=1e-6)
        assert r["train_eager"][-1] < r["train_eager"][0]
