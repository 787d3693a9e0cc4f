"""ZeRO-Offload / ZeRO-Infinity on CUDA: real host<->device traffic, pinned host buffers, parity.

Each run trains test_zero_parity's model twice in the same ranks — without offload and with it —
on one GPU (one rank) or two (NCCL). The offloaded run must give the same losses within 1e-4 over
10 steps (not 1e-5: its step is torch's fused CPU AdamW, the other the CUDA AdamW — the same
formula, rounded differently), keep the model's weights on the GPU, and hold what it offloads in
host memory: fp32 masters, optimizer states, fp32 gradient shards (stage 3: also the parameter
shards), the buffers that cross to and from the GPU pinned.
"""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CPU_PINNED = {"device": "cpu", "pin_memory": True}


def _common(r):
    diffs = [abs(a - b) for a, b in zip(r["losses"], r["base"])]
    assert len(diffs) == gc.STEPS and max(diffs) <= 1e-4, diffs
    assert r["losses"][-1] < r["losses"][0] - 0.05  # it trains
    assert r["model_devices"] == ["cuda"]
    assert r["base_placement"]["master_weights"].startswith("cuda")  # without offload: all on the GPU
    assert r["left"] == []  # swap files removed by engine.destroy()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_optimizer_offload_on_gpu(stage):
    world = min(2, gc.gpus())
    for r in run_distributed(gc.offload_ranks, world, stage, CPU_PINNED, None, timeout=170, backend="nccl"):
        _common(r)
        p = r["placement"]
        assert p["master_weights"] == "cpu" and p["optimizer_states"] == "cpu" and p["gradients"] == "cpu", p
        assert p["parameters"].startswith("cuda"), p
        assert r["masters"] and all(m == ("cpu", True) for m in r["masters"]), r["masters"]  # pinned fp32 masters
        assert r["states"] == ["cpu"]
        if stage == 3:
            assert all(g == ("cpu", True) for g in r["grad_shards"]), r["grad_shards"]
            assert all(s[0] == "cuda" for s in r["shards"]), r["shards"]


@pytest.mark.timeout(200)
def test_stage3_cpu_parameter_offload_on_gpu():
    world = min(2, gc.gpus())
    for r in run_distributed(gc.offload_ranks, world, 3, CPU_PINNED, CPU_PINNED, timeout=170, backend="nccl"):
        _common(r)
        assert r["placement"] == {
            "parameters": "cpu",
            "gradients": "cpu",
            "master_weights": "cpu",
            "optimizer_states": "cpu",
        }, r["placement"]
        # every gather copies pinned host shards to the GPU; gradients come back into pinned shards
        assert r["shards"] and all(s == ("cpu", True) for s in r["shards"]), r["shards"]
        assert all(g == ("cpu", True) for g in r["grad_shards"]), r["grad_shards"]
        assert all(m == ("cpu", True) for m in r["masters"]), r["masters"]


@pytest.mark.timeout(200)
def test_stage3_nvme_optimizer_and_parameter_offload_on_gpu(tmp_path):
    world = min(2, gc.gpus())
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    results = run_distributed(
        gc.offload_ranks,
        world,
        3,
        nvme | {"pipeline_read": True, "pipeline_write": True},
        nvme | {"buffer_size": 16384},
        timeout=170,
        backend="nccl",
    )
    for r in results:
        _common(r)
        where = f"nvme:{tmp_path.resolve()}"
        assert r["placement"]["parameters"] == where and r["placement"]["optimizer_states"] == where, r["placement"]
        assert r["swap_files"], "no swap files were written"
        assert all(g == ("cpu", True) for g in r["grad_shards"]), r["grad_shards"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage, param", [(2, None), (3, None), (3, CPU_PINNED)])
def test_the_overlapped_host_step_equals_the_sequential_one_on_gpu(stage, param):
    """overlap_step (the default) against overlap_step false, pinned host buffers, clipping on: the same CPU
    AdamW on the same sub-groups, so bitwise equal; at stage 3 with parameter offload the step returns
    before the last host steps and the next forward's gathers wait per sub-group."""
    world = min(2, gc.gpus())
    for r in run_distributed(gc.overlap_ranks, world, stage, param, timeout=270, backend="nccl"):
        assert r[True]["losses"] == r[False]["losses"], (r[True]["losses"], r[False]["losses"])
        for k, v in r[False]["state"].items():
            assert torch.equal(r[True]["state"][k], v), k
        assert r[True]["deferred"] == (param is not None), r[True]
