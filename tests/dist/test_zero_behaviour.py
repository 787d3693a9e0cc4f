"""ZeRO 1/2 behaviour beyond parity: unused parameters, no_sync, optimizer checks, client optimizers."""

import pytest
import torch
from test_engine_behaviour import Branchy  # noqa: E402  (tests/dist is on sys.path)

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.config import ConfigError


def cfg(stage, **over):
    c = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20},
    }
    c.update(over)
    return c


def _behaviour(stage):
    rank = comm.get_rank()
    out = {}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    # rank 1 leaves layer 2 unused: the job still steps, and layer 2 gets rank 0's averaged gradient
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=Branchy(), config=cfg(stage))
    engine.backward(engine(x, skip=(rank == 1)))
    engine.step()
    out["weights"] = [p.detach().clone() for p in engine.module.parameters()]
    # with ignore_unused_parameters false the same situation is an error naming the parameter
    torch.manual_seed(0)
    strict, *_ = zerospeed.initialize(
        model=Branchy(),
        config=cfg(
            stage, zero_optimization={"stage": stage, "reduce_bucket_size": 20, "ignore_unused_parameters": False}
        ),
    )
    try:
        strict.backward(strict(x, skip=True))  # both ranks skip: symmetric, nobody hangs
        strict.step()
        out["strict"] = "no error"
    except RuntimeError as e:
        out["strict"] = str(e)
    try:
        with engine.no_sync():
            pass
        out["no_sync"] = "allowed"
    except RuntimeError as e:
        out["no_sync"] = str(e)
    try:
        zerospeed.initialize(model=Branchy(), config=cfg(stage, optimizer={"type": "Lamb", "params": {"lr": 0.1}}))
        out["lamb"] = "accepted"
    except ConfigError as e:
        out["lamb"] = str(e)
    # a client optimizer instance is re-pointed at this rank's shard and trains identically
    torch.manual_seed(0)
    model = Branchy()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    ce, opt, *_ = zerospeed.initialize(model=model, optimizer=client, config=cfg(stage, optimizer=None))
    ce.backward(ce(x, skip=(rank == 1)))
    ce.step()
    out["client_same"] = all(torch.equal(a, b) for a, b in zip(out["weights"], ce.module.parameters()))
    out["client_is_returned"] = opt is client
    out["breakdown"] = engine.memory_breakdown()
    return out


def _every_stage(stages):
    return {stage: _behaviour(stage) for stage in stages}  # one spawn: starting processes is the slow part


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_every_stage, 2, (1, 2), timeout=160)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_behaviour(stage, runs):
    r0, r1 = (rank[stage] for rank in runs)
    for a, b in zip(r0["weights"], r1["weights"]):
        assert torch.equal(a, b)
    assert "received no gradient" in r0["strict"] and "ignore_unused_parameters" in r0["strict"]
    if stage == 2:
        assert (
            "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2" in r0["no_sync"]
        )
    else:
        assert r0["no_sync"] == "allowed"
    assert "zero_allow_untested_optimizer" in r0["lamb"] and "Lamb" in r0["lamb"]
    assert r0["client_same"] and r0["client_is_returned"]
    measured, predicted = r0["breakdown"]["measured"], r0["breakdown"]["predicted"]
    assert set(measured) == set(predicted) == {"parameters", "gradients", "master_weights", "optimizer_states"}
