"""The CUDA accelerator's DeepSpeed API answers what torch.cuda answers (devices, RNG, memory, streams,
graphs, dtypes, pinning); tests/unit/test_accelerator_api.py checks the names and the CPU answers."""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(120)
def test_cuda_accelerator_matches_torch_cuda():
    (r,) = run_distributed(gc.accelerator_api_ranks, 1, timeout=100, backend="nccl")
    wrong = {name: pair for name, pair in r.items() if pair[0] != pair[1]}
    assert not wrong, wrong
