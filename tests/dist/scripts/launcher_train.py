"""Launcher test helper: a few data-parallel steps of TinyMLP through zerospeed.

Each rank writes ``<--out>/train<rank>.json``: its per-step losses, the world it saw and how it
was reached (``SSH_CONNECTION`` names the "node" address an ssh-started rank runs behind,
``SLURMD_NODENAME`` the Slurm node). The test imports ``make_model`` / ``global_batches`` / ``CONFIG``
to train the same steps in one plain process.
"""

import argparse
import json
import os

import torch

STEPS, GLOBAL_BATCH = 4, 8
CONFIG = {
    "train_batch_size": GLOBAL_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 1},
}


def make_model() -> torch.nn.Module:
    from zoo.models import TinyMLP

    torch.manual_seed(0)
    return TinyMLP()


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)) for _ in range(STEPS)
    ]


def main() -> None:
    import zerospeed
    from harness.reference import split_global_batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for train<rank>.json")
    parser.add_argument("--local_rank", type=int, default=0)
    out = parser.parse_args().out
    engine, *_ = zerospeed.initialize(model=make_model(), config=CONFIG)
    rank, world = engine.global_rank, engine.world_size
    losses = []
    for batch in global_batches():
        ((x, y),) = split_global_batch(batch, world, 1, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    record = {
        "rank": rank,
        "world": world,
        "losses": losses,
        "pid": os.getpid(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        "slurm_node": os.environ.get("SLURMD_NODENAME", ""),
    }
    with open(os.path.join(out, f"train{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
