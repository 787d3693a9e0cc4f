"""engine.offload_states() / reload_states() on a GPU (Note [offloaded states]): the device memory the
training states held is freed into pinned host copies and comes back, and the weights after the round
trip are plain PyTorch's. (tests/dist/test_offload_states.py checks the rest on the CPU, where host and
device are one memory.)"""

import gpu_cases as gc
import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(200)
def test_offload_states_frees_device_memory_into_pinned_host_copies_and_reloads_it():
    stages = [0, 2, 3]
    (r,) = run_distributed(gc.offload_states_ranks, 1, stages, timeout=170, backend="nccl")
    _, ref_state = r["reference"]
    for stage in stages:
        got = r[stage]
        # fp32 on one rank: weights (masters alias them) 4 B, gradient 4 B and Adam's two moments 8 B per
        # trainable element, counted from the model itself; padding only adds
        states = 16 * got["numel"]
        assert got["before"] - got["after"] >= states, (stage, got["before"], got["after"], states)
        assert got["reloaded"] - got["after"] >= states, stage
        assert got["pinned"] and all(got["pinned"]), stage
        for kind in ("optim_states", "hp_params", "lp_params", "lp_grads"):
            assert got["devices"][kind] == ["cpu"], (stage, kind, got["devices"])
        for key, value in ref_state.items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=0, msg=f"stage {stage} {key}")
