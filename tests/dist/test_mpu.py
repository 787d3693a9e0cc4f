"""`initialize(mpu=...)` trains over the mpu's data-parallel groups, and `engine.mpu` hands one back.

Four ranks, a Megatron-style layout with 2 model-parallel ranks (ParallelMesh.build(tp=2).as_mpu():
data-parallel groups {0, 2} and {1, 3}). The model is replicated (no tensor parallelism yet), each
data-parallel group trains on its own batches; each must match a plain PyTorch run of 2 virtual
ranks on that group's batches, and the two groups must not have averaged with each other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh

DP, GAS, MICRO, STEPS = 2, 2, 2, 10
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 1},
}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))


def loss_fn(m, x, y):
    return (m(x) - y).pow(2).mean()


def batches(group: int):
    g = torch.Generator().manual_seed(10 + group)
    n = DP * GAS * MICRO
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)) for _ in range(STEPS)]


def _train():
    mpu = ParallelMesh.build(tp=2).as_mpu()
    net = model()
    engine, *_ = zerospeed.initialize(model=net, config=CONFIG, mpu=mpu)
    group = mpu.get_model_parallel_rank()  # which data-parallel group: {0, 2} -> 0, {1, 3} -> 1
    dp_rank = mpu.get_data_parallel_rank()
    losses = []
    for batch in batches(group):
        total = 0.0
        for x, y in split_global_batch(batch, DP, GAS, dp_rank):
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg", group=mpu.get_data_parallel_group())
        losses.append(t.item())
    back = engine.mpu
    return {
        "group": group,
        "losses": losses,
        "weights": [p.detach().clone() for p in net.parameters()],
        "sizes": (engine.dp_world_size, back.get_data_parallel_world_size(), back.get_model_parallel_world_size()),
        "dp_members": engine.mesh.members("dp"),
    }


@pytest.mark.timeout(200)
def test_an_mpu_sets_the_data_parallel_groups_and_engine_mpu_hands_them_back():
    results = run_distributed(_train, 4, timeout=180)
    for rank, r in enumerate(results):
        assert r["sizes"] == (2, 2, 2)
        assert r["dp_members"] == [rank % 2, rank % 2 + 2] and r["group"] == rank % 2
    for group in (0, 1):
        ref = model()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW default
        ref_losses = reference_train(ref, opt, batches(group), world_size=DP, grad_accum=GAS, loss_fn=loss_fn, clip=1.0)
        for r in results[group::2]:
            assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= 1e-5
            for got, want in zip(r["weights"], ref.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    # the groups trained apart: averaging across them would have made them equal
    assert not torch.allclose(results[0]["weights"][0], results[1]["weights"][0])
