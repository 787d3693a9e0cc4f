"""Elastic-training test helper: the training script of tests/dist/test_elastic_training.py.

Started by the ``zerospeed`` launcher (``--elastic_training``), once per rank and per worker
generation. It loads ``latest`` from ``<--out>/ckpt`` if there is one, then trains until step
``STEPS``, saving a checkpoint after every step. Before step n it waits for the gate file
``<--out>/go<n>``, so that the test puts membership changes between steps. Rank 0 appends its events
(``start``, each ``step``'s loss and ``saved``) to ``<--out>/log.jsonl``; every rank records its pid as
``<--out>/pid.<ELASTIC_NODE>.<pid>`` (the test kills a lost node's ranks by these). The test imports
``make_model``, ``global_batch`` and ``reference_losses``.
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS = 6
GLOBAL_BATCH = 8
ELASTICITY = {
    "enabled": True,
    "max_train_batch_size": GLOBAL_BATCH,
    "micro_batch_sizes": [2],
    "min_gpus": 1,
    "max_gpus": 2,
}
CONFIG = {
    "elasticity": ELASTICITY,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2},
}
DIM, HIDDEN = 16, 64  # 2,128 parameters


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of global step ``step`` (0-based), the same at every world size."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g)


def reference_losses() -> list[float]:
    """One plain PyTorch process on the same global batches (Adam with weight_decay 0 = zerospeed's "Adam")."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _wait_gate(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


def main() -> None:
    import zerospeed
    from zerospeed import comm

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=0)
    out = parser.parse_args().out
    node = os.environ["ELASTIC_NODE"]
    (out / f"pid.{node}.{os.getpid()}").touch()
    comm.init_distributed(timeout=datetime.timedelta(seconds=30))  # a lost peer must fail, never hang
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    ckpt = out / "ckpt"
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))  # saved at any world size: reshards on load
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    def record(event: dict) -> None:
        if rank == 0:
            with open(out / "log.jsonl", "a") as f:
                f.write(
                    json.dumps(
                        {
                            **event,
                            "time": round(time.time(), 2),
                            "world": world,
                            "micro": micro,
                            "gas": gas,
                            "train_batch": engine.train_batch_size(),
                            "node": node,
                            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        }
                    )
                    + "\n"
                )

    record({"event": "start", "step": engine.global_steps})
    while engine.global_steps < STEPS:
        step = engine.global_steps
        _wait_gate(out / f"go{step + 1}")
        x, y = global_batch(step)
        total = torch.zeros(())
        for m in range(gas):  # micro-step m of rank r takes the (m * world + r)-th slice of the global batch
            lo = (m * world + rank) * micro
            loss = F.mse_loss(engine(x[lo : lo + micro]), y[lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        record({"event": "step", "step": step + 1, "loss": total.item() / (gas * world)})  # before the save: a
        engine.save_checkpoint(str(ckpt))  # step killed between the two is redone and logged again
        record({"event": "saved", "step": step + 1})


if __name__ == "__main__":
    main()
