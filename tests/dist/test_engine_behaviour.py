"""Stage-0 engine behaviour on 2 gloo ranks: data sharding, buckets and overlap, unused parameters,
no_sync and forced boundaries, reduced-precision communication."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import run_distributed
from zerospeed import comm

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 20},
}


class Branchy(torch.nn.Module):
    """Four 4x4 layers (20 elements each); `skip` leaves layer 2 out of the graph."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, skip=False):
        for i, layer in enumerate(self.layers):
            if not (skip and i == 2):
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _sharding_and_overlap():
    rank = comm.get_rank()
    data = torch.utils.data.TensorDataset(torch.arange(12.0).unsqueeze(1))
    torch.manual_seed(rank)  # different init per rank: the engine must broadcast rank 0's
    model = Branchy()
    engine, _, loader, _ = zerospeed.initialize(model=model, config=BASE, training_data=data)
    seen = [int(v) for (batch,) in loader for v in batch.flatten()]

    # Record the order of gradient hooks and bucket launches during one synced backward.
    events = []
    reducer = engine.zero.reducer
    on_grad, launch = reducer._on_grad, reducer._launch

    def traced_on_grad(p):
        events.append("grad")
        on_grad(p)

    def traced_launch(b):
        events.append("launch")
        launch(b)

    reducer._on_grad, reducer._launch = traced_on_grad, traced_launch
    for h in reducer._hooks:
        h.remove()
    reducer._hooks = [p.register_post_accumulate_grad_hook(reducer._on_grad) for u in reducer.units for p in u.members]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x))
    reducer.finish()
    grads = {id(p): g.clone() for p, g in engine.zero.grads()}
    weights = [p.detach().clone() for p in engine.module.parameters()]
    return {
        "seen": seen,
        "events": events,
        "n_buckets": len(reducer.units),
        "grads": [grads[id(p)] for p in engine.module.parameters()],
        "weights": weights,
    }


@pytest.mark.timeout(120)
def test_loader_shards_and_buckets_overlap_backward():
    r0, r1 = run_distributed(_sharding_and_overlap, 2, timeout=100)
    # each rank sees half of the data, together all of it, no overlap
    assert len(r0["seen"]) == len(r1["seen"]) == 6
    assert sorted(r0["seen"] + r1["seen"]) == list(range(12))
    # rank 0's weights were broadcast; reduced gradients are identical on both ranks
    for a, b in zip(r0["weights"], r1["weights"]):
        assert torch.equal(a, b)
    for a, b in zip(r0["grads"], r1["grads"]):
        assert torch.equal(a, b)
    # 8 parameters of 16 or 4 elements in 20-element buckets -> several buckets, and the first is
    # launched before the last gradient exists: communication overlaps backward.
    assert r0["n_buckets"] >= 3
    events = r0["events"]
    assert events.count("launch") == r0["n_buckets"] and events.count("grad") == 8
    assert events.index("launch") < len(events) - 1 - events[::-1].index("grad")


def _unused_and_no_sync(comm_type):
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = Branchy()
    cfg = dict(BASE, gradient_accumulation_steps=2)
    if comm_type:
        cfg["communication_data_type"] = comm_type
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    # rank 1 leaves layer 2 unused on both micro-steps; rank 0 uses everything
    for _ in range(2):
        engine.backward(engine(x, skip=(rank == 1)))
        engine.step()
    after_step = [p.detach().clone() for p in engine.module.parameters()]
    # no_sync: the gradients stay local (they differ by rank), a step inside is refused as in DeepSpeed (it would
    # update each rank from its own gradients), and the next boundary backward outside reduces them with its own
    engine.set_gradient_accumulation_boundary(False)
    with engine.no_sync():
        engine.backward(engine(x))
        try:
            engine.step()
            refused = None
        except AssertionError as e:
            refused = str(e)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x))
    engine.step()
    synced = [p.detach().clone() for p in engine.module.parameters()]
    return {
        "after_step": after_step,
        "refused": refused,
        "synced": synced,
        "steps": engine.global_steps,
        "micro": engine.micro_steps,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm_type", [None, "bf16"])
def test_unused_parameters_no_deadlock_and_no_sync(comm_type):
    r0, r1 = run_distributed(_unused_and_no_sync, 2, comm_type, timeout=100)
    for a, b in zip(r0["after_step"], r1["after_step"]):
        assert torch.equal(a, b)  # the unused layer on rank 1 still got rank 0's averaged gradient
    assert "It is illegal to call Engine.step() inside no_sync context manager" in r0["refused"]
    for a, b in zip(r0["synced"], r1["synced"]):
        assert torch.equal(a, b)  # the window's gradients, held apart inside no_sync, were reduced at the boundary
    assert any(not torch.equal(a, before) for a, before in zip(r0["synced"], r0["after_step"]))
    assert r0["steps"] == 2 and r0["micro"] == 3
