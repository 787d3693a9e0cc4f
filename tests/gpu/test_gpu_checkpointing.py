"""Activation checkpointing on CUDA: cpu_checkpointing moves the kept inputs to pinned host memory
(and frees their GPU memory), the recompute replays the GPU's dropout masks, and gradients equal a
plain run on the same GPU; with two GPUs, partition_activations all-gathers the halves over NCCL."""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _same_grads(got_steps, want_steps, name):
    for got_step, want_step in zip(got_steps, want_steps):
        for got, want in zip(got_step, want_step):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)


@pytest.mark.timeout(200)
def test_cpu_checkpointing_on_one_gpu():
    import test_activation_checkpointing_dist as ac

    (r,) = run_distributed(gc.cpu_checkpointing_ranks, 1, timeout=170, backend="nccl")
    numel = ac.B * ac.T * ac.D
    for name in ("cpu", "cpu+contiguous"):
        res = r[name]
        # every block input: a full copy in pinned host memory, restored to the GPU it came from
        assert res["kept"] == [("cpu", True, "cuda:0", False, numel)], (name, res["kept"])
        assert res["n_kept"] == [ac.N_BLOCKS] * ac.STEPS
        _same_grads(res["grads"], r["reference"], name)
        assert not res["device_buffer"]
    # contiguous: one pinned host buffer of number_checkpoints 256-byte-aligned slots
    assert r["cpu+contiguous"]["host_buffer"] == (ac.N_BLOCKS * (-(-numel * 4 // 256) * 256), True)
    assert r["cpu"]["host_buffer"] is None
    # the GPU no longer holds the inputs of blocks 2..4 between forward and backward (exactly)
    saved = r["held_plain"] - r["held_cpu"]
    assert abs(saved - 3 * r["act_bytes"]) <= 4096, (saved, r["act_bytes"])


@pytest.mark.skipif(gc.gpus() < 2, reason="partitioning needs a 2-rank model-parallel group (2 GPUs)")
@pytest.mark.timeout(200)
def test_partitioned_checkpoints_all_gather_over_nccl():
    import test_activation_checkpointing_dist as ac

    half = -(-ac.B * ac.T * ac.D // 2)
    for rank, r in enumerate(run_distributed(gc.partitioned_checkpointing_ranks, 2, timeout=170, backend="nccl")):
        expect = {
            "partition": [("cuda", False, f"cuda:{rank}", True, half)],
            "partition+cpu": [("cpu", True, f"cuda:{rank}", True, half)],
            "partition+cpu+contiguous": [("cpu", True, f"cuda:{rank}", True, half)],
        }
        for name, kept in expect.items():
            assert r[name]["kept"] == kept, (name, rank, r[name]["kept"])
            assert r[name]["gathers"] == [ac.N_BLOCKS] * ac.STEPS  # one device all-gather per recompute
            _same_grads(r[name]["grads"], r["reference"], name)
