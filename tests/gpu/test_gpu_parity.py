"""The stage-0 training checks on CUDA/NCCL (skipped without a GPU)."""
import pytest
import torch

from zerospeed.testing import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_stage0_trains_on_gpus(precision):
    import test_engine_parity as parity  # tests/dist is on sys.path (tests/conftest.py)

    cfg = parity.parity_config(**({precision: {"enabled": True}} if precision else {}))
    world = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    results = run_distributed(parity.train_ranks, world, cfg, 12, timeout=240, backend="nccl")
    losses = results[0]["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
    for r in results[1:]:
        for k, v in results[0]["state"].items():
            assert torch.equal(v, r["state"][k]), k
