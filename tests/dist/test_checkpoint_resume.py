"""Exact resume at ZeRO stages 0, 1, 2 and 3 on 2 ranks: N steps, save, a fresh engine loads, M more steps
equals N+M uninterrupted steps bitwise — weights, optimizer states, data order, RNG, scheduler, counters.

The shared model, configs and helpers of the checkpoint tests live here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_zero_parity import GAS, MICRO, MODEL, SEQ, param_groups, zero_config  # noqa: F401  (re-exported)

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.zero.shards import parameter_names
from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.models import GPT


class BufferedGPT(GPT):
    """The parity GPT (tied embedding/head, odd trainable count) with buffers, which checkpoints must carry."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, cfg.block_size))
        self.register_buffer("seen_batches", torch.zeros((), dtype=torch.int64))

    def forward(self, idx_BT, targets_BT=None):
        self.seen_batches += 1  # a buffer that changes during training
        return super().forward(idx_BT, targets_BT)


def build_model(seed: int = 0) -> BufferedGPT:
    torch.manual_seed(seed)
    model = BufferedGPT(MODEL)
    model.wpe.weight.requires_grad_(False)  # frozen: travels in the module state, not in the shards
    return model


def make_engine(config, seed: int = 0, training_data=None):
    model = build_model(seed)
    engine, _, loader, _ = zerospeed.initialize(
        model=model, model_parameters=param_groups(model), config=config, training_data=training_data
    )
    return engine, loader


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def module_state(engine) -> dict:
    """The full module state on every rank (stage 3 gathers its sharded parameters for the copy)."""
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def rank_snapshot(engine) -> dict:
    """Everything a rank holds that training depends on, as plain tensors and numbers."""
    opt = engine.optimizer
    entries = engine.zero.shard_entries(parameter_names(engine.module))
    return {
        "module": module_state(engine),
        "masters": [e.master.detach().clone() for e in entries],
        "states": [
            {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in opt.state.get(e.master, {}).items()
            }
            for e in entries
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps),
        "scheduler": engine.lr_scheduler.state_dict(),
    }


def _train(engine, batches, steps: int, log: list) -> None:
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        # Every RNG scales the loss a little, so a resume that restored any of them wrongly diverges.
        factor = 1 + 0.01 * (torch.rand(()).item() + random.random() + float(np.random.rand()))
        loss = engine(x, y) * factor
        engine.backward(loss)
        engine.step()
        log.append((x[:, 0].tolist(), loss.item()))


def _resume_job(stage: int, ckpt_dir: str, n: int = 3, m: int = 3) -> dict:
    config = zero_config(stage)
    # 22 samples: 11 per rank, 6 micro-batches per epoch (the last one short), so the run crosses an
    # epoch boundary and the save lands in the middle of an epoch.
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=22 * SEQ + 1), SEQ)

    whole, whole_loader = make_engine(config, training_data=data)
    seed_everything(7)
    log_whole: list = []
    _train(whole, iter(zerospeed.RepeatingLoader(whole_loader)), n + m, log_whole)
    rng_whole = (torch.rand(2), random.random(), float(np.random.rand()))

    first, first_loader = make_engine(config, training_data=data)
    seed_everything(7)
    log_first: list = []
    _train(first, iter(zerospeed.RepeatingLoader(first_loader)), n, log_first)
    first.save_checkpoint(ckpt_dir, client_state={"note": f"stage {stage}"})
    del first

    resumed, resumed_loader = make_engine(config, seed=1, training_data=data)  # other initial weights
    batches = zerospeed.RepeatingLoader(resumed_loader)  # built before the load: it must still resume
    seed_everything(99)  # other RNG states, which the load must overwrite
    path, client = resumed.load_checkpoint(ckpt_dir)
    log_resumed: list = []
    _train(resumed, batches, m, log_resumed)
    rng_resumed = (torch.rand(2), random.random(), float(np.random.rand()))
    return {
        "whole": rank_snapshot(whole),
        "resumed": rank_snapshot(resumed),
        "path": path,
        "client": client,
        "log_whole": log_whole,
        "log_first": log_first,
        "log_resumed": log_resumed,
        "rng": (rng_whole, rng_resumed),
        "rank": comm.get_rank(),
    }


def assert_same(a, b, where: str) -> None:
    """Bitwise equality of nested dicts / lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max |diff| {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _resume_all_stages(root: str) -> dict:
    # One job for the three stages: starting processes costs more here than the training itself.
    return {stage: _resume_job(stage, f"{root}/stage{stage}") for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, run_distributed(_resume_all_stages, 2, str(root), timeout=170)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(resumed, stage):
    root, by_rank = resumed
    results = [r[stage] for r in by_rank]
    n, m = 3, 3
    for r in results:
        rank = r["rank"]
        assert r["path"] == str(root / f"stage{stage}" / "global_step3" / "mp_rank_00_model_states.pt")
        assert r["client"] == {"note": f"stage {stage}"}
        assert len(r["log_whole"]) == (n + m) * GAS
        # same data, in the same order, and the same losses, step for step
        assert r["log_first"] + r["log_resumed"] == r["log_whole"], f"rank {rank}"
        assert_same(r["rng"][0], r["rng"][1], f"rank {rank} rng")
        assert_same(r["whole"], r["resumed"], f"rank {rank} stage {stage}")
        assert r["resumed"]["counters"] == (n + m, (n + m) * 2 * MICRO * GAS, 0, (n + m) * GAS)
        assert r["resumed"]["states"][0]["step"].item() == n + m
    # the ranks really hold different shards at stages 1-3 (so each restored its own)
    if stage > 0:
        m0, m1 = (r["whole"]["masters"] for r in results)
        assert not all(torch.equal(a, b) for a, b in zip(m0, m1))
