"""CPU / NVMe offload on CUDA: parity with the same run without offload, and the placement map says
the offloaded state is on the host (skipped without a GPU)."""
import pytest
import torch

from zerospeed.testing import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,param", [(2, False), (3, True)])
def test_cpu_offload_on_gpu_matches_no_offload(stage, param, tmp_path):
    import test_offload as off  # tests/dist is on sys.path (tests/conftest.py)

    world = min(2, torch.cuda.device_count())
    results = run_distributed(off._compare, world, stage, {"device": "cpu", "pin_memory": True},
                              {"device": "cpu", "pin_memory": True} if param else None, {}, timeout=280,
                              backend="nccl")
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], r["base"])) <= 1e-4
        assert r["placement"]["master_weights"] == "cpu" and r["placement"]["gradients"] == "cpu"
        assert r["placement"]["parameters"] == "cpu" if param else r["placement"]["parameters"].startswith("cuda")


@pytest.mark.timeout(300)
def test_nvme_offload_on_gpu_matches_no_offload(tmp_path):
    import test_offload as off

    world = min(2, torch.cuda.device_count())
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    results = run_distributed(off._compare, world, 3, nvme | {"pipeline_read": True, "pipeline_write": True},
                              nvme | {"buffer_size": 4096}, {}, timeout=280, backend="nccl")
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], r["base"])) <= 1e-4
        assert r["left"] == []
