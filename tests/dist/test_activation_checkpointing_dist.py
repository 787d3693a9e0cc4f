"""partition_activations over a 2-rank model-parallel group (gloo): each rank keeps half of every
checkpointed input, all-gathers it for the recompute, and the gradients equal a single-process run
without checkpointing. With a model-parallel group of size 1 it is a no-op that warns once."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from harness.mpu import GroupMpu
from zerospeed import checkpointing, comm
from zerospeed.activation.stash import SavedInput

# B*T*D = 465 is odd: the second rank's chunk ends in one padding element.
B, T, D, N_BLOCKS, STEPS = 3, 5, 31, 4, 2
CASES = {
    "partition": {},
    "partition+cpu": {"checkpoint_in_cpu": True},
    "partition+contiguous": {"contiguous_checkpointing": True, "num_checkpoints": N_BLOCKS},
    "partition+cpu+contiguous": {
        "checkpoint_in_cpu": True,
        "contiguous_checkpointing": True,
        "num_checkpoints": N_BLOCKS,
    },
}


class DropBlock(nn.Module):
    """Pre-LN residual MLP with dropout p=0.3 (the recompute must replay the masks)."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln(x)))), 0.3, True)


def build():
    torch.manual_seed(0)
    blocks = nn.ModuleList(DropBlock() for _ in range(N_BLOCKS))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return blocks, x


def step(blocks, x, checkpointed: bool, seed: int):
    """Forward + backward; returns (grads of params and x, (numel, device, partitioned) of what each
    checkpoint kept, read before the backward releases it)."""
    torch.manual_seed(seed)
    for p in blocks.parameters():
        p.grad = None
    x.grad = None
    h, kept = x, []
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h) if checkpointed else blk(h)
        if checkpointed:
            kept += [
                (s.data.numel(), s.data.device.type, s.partitioned)
                for s in h.grad_fn.saved
                if isinstance(s, SavedInput)
            ]
    (h * h).mean().backward()
    return [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()], kept


def reference_grads() -> list[list[torch.Tensor]]:
    """Per step, the gradients of a plain (uncheckpointed) run in this one process."""
    blocks, x = build()
    return [step(blocks, x, checkpointed=False, seed=100 + s)[0] for s in range(STEPS)]


def partition_worker():
    mpu = GroupMpu(comm.new_group([0, 1]))
    out = {}
    for name, extra in CASES.items():
        checkpointing.unconfigure()
        checkpointing.configure(mpu, partition_activations=True, **extra)
        blocks, x = build()
        grads, kept_numel, kept_devices, gathers = [], set(), set(), []
        for s in range(STEPS):
            before = comm.STATS.snapshot().get("all_gather", {}).get("calls", 0)
            g, kept = step(blocks, x, checkpointed=True, seed=100 + s)
            gathers.append(comm.STATS.snapshot()["all_gather"]["calls"] - before)
            grads.append(g)
            kept_numel |= {numel for numel, _, _ in kept}
            kept_devices |= {device for _, device, _ in kept}
            assert all(partitioned for _, _, partitioned in kept) and len(kept) == N_BLOCKS
        buffer = checkpointing.contiguous_buffer()
        out[name] = {
            "grads": grads,
            "kept_numel": kept_numel,
            "kept_devices": kept_devices,
            "gathers": gathers,
            "buffer_bytes": None if buffer is None else buffer.numel(),
        }
    checkpointing.unconfigure()
    return out


@pytest.mark.timeout(150)
def test_partitioned_checkpoints_keep_half_and_match_a_single_process_run():
    results = run_distributed(partition_worker, 2, timeout=120)
    ref = reference_grads()
    half = -(-B * T * D // 2)  # 233
    for name in CASES:
        per_rank = [r[name] for r in results]
        for rank, res in enumerate(per_rank):
            assert res["kept_numel"] == {half}, (name, rank)  # each rank keeps half of each input
            assert res["kept_devices"] == {"cpu"}
            assert res["gathers"] == [N_BLOCKS] * STEPS  # one all-gather per recompute
            for got_step, want_step in zip(res["grads"], ref):
                for got, want in zip(got_step, want_step):
                    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        if "contiguous" in name:  # number_checkpoints slots of one half-input, 256-byte aligned
            assert per_rank[0]["buffer_bytes"] == N_BLOCKS * 1024


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def solo_group_worker():
    # every rank creates every group, in the same order; each rank's mpu is its own 1-rank group
    groups = [comm.new_group([r]) for r in range(comm.get_world_size())]
    mpu = GroupMpu(groups[comm.get_rank()])
    collect = _Collect()
    logging.getLogger("zerospeed.activation").addHandler(collect)
    checkpointing.configure(mpu, partition_activations=True)
    checkpointing.configure(mpu, partition_activations=True)
    blocks, x = build()
    before = comm.STATS.snapshot().get("all_gather", {}).get("calls", 0)
    grads, kept = [], []
    for s in range(STEPS):
        g, k = step(blocks, x, checkpointed=True, seed=100 + s)
        grads.append(g)
        kept += k
    gathers = comm.STATS.snapshot().get("all_gather", {}).get("calls", 0) - before
    return {
        "grads": grads,
        "warnings": collect.messages,
        "gathers": gathers,
        "partitioned": any(partitioned for _, _, partitioned in kept),
    }


@pytest.mark.timeout(150)
def test_model_parallel_size_one_is_a_no_op_that_warns_once():
    results = run_distributed(solo_group_worker, 2, timeout=120)
    ref = reference_grads()
    for res in results:
        assert len(res["warnings"]) == 1
        assert "partition_activations=true has no effect: the model-parallel world size is 1" in res["warnings"][0]
        assert res["gathers"] == 0 and not res["partitioned"]
        for got_step, want_step in zip(res["grads"], ref):
            for got, want in zip(got_step, want_step):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
