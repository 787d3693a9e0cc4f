"""Checkpoints of Ulysses sequence-parallel engines: saved at (sp 2, dp 2), resumed at other sequence- and
data-parallel splits and ZeRO stages — against one plain PyTorch run.

test_ulysses_parity's GPT (GQA: 4 query, 2 kv heads; at sp 4 each kv head is replicated on two ranks)
trains K steps at (sp 2, dp 2, ZeRO-2) on 4 ranks and saves (Note [sequence-parallel checkpoints] in
checkpoint/save.py: the ZeRO state is partitioned over dp x sp = 4 ranks, one rank file each). Fresh
engines then load that checkpoint and train N more steps at (sp 4, dp 1, ZeRO-3), (sp 1, dp 4, ZeRO-1)
and (sp 2, dp 2, ZeRO-2) — the last reads its rank files as they are, the others reshard them.

The reference is one plain process (torch.optim.Adam, SDPA over the whole sequence, F.cross_entropy)
that trains K + N steps on the same global batches of G sequences, each step's loss the mean over the
data-parallel replicas of that step's layout of their token-mean losses (DDP's semantics, as the engine
computes them): every rank's loss at every resumed step within 1e-5 of its replica's reference loss, and
the final weights within 1e-5 — which needs the weights, Adam's moments and step all restored.
"""

from __future__ import annotations

import pytest
import torch
from test_ulysses_parity import SPLoss, reference_step, sp_steps

import zerospeed
from harness import run_distributed
from zerospeed.sequence.layer import DistributedAttention
from zoo.sequence_models import GPT, VOCAB, local_sdpa

SEQ, G, K, N, LR, TOL, WORLD = 13, 4, 3, 3, 1e-2, 1e-5, 4
WIDTH, HEADS, KV = 16, 4, 2
SAVE = (2, 2)  # (sp, zero stage) of the saving run; dp = WORLD // sp
RESUMES = [(4, 3), (1, 1), (2, 2)]


def batches():
    """K + N global batches of G right-padded sequences with scattered -100 labels."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(K + N):
        ids = torch.randint(0, VOCAB, (G, SEQ), generator=g)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
        for row in range(G):
            pad = int(torch.randint(0, 4, (), generator=g))
            if pad:
                ids[row, SEQ - pad :], labels[row, SEQ - pad :] = 0, -100
        out.append((ids, labels))
    return out


def _engine(sp: int, stage: int):
    box = {}
    torch.manual_seed(0)
    gpt = GPT(WIDTH, HEADS, KV, lambda q, k, v: box["attn"](q, k, v, batch_dim_idx=0))
    mesh = zerospeed.comm.ParallelMesh.build(sp=sp)
    box["attn"] = DistributedAttention(local_sdpa, mesh.group("sp"))
    dp = WORLD // sp
    cfg = {
        "train_micro_batch_size_per_gpu": G // dp,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=SPLoss(gpt, mesh.group("sp")), config=cfg, mesh=mesh)
    return engine, gpt, mesh


def _steps(engine, mesh, steps) -> list[float]:
    return sp_steps(engine, mesh, steps, G // mesh.size("dp"))  # the global batch stays G at every dp


def _ranks(save_dir: str) -> dict:
    data = batches()
    engine, _, mesh = _engine(*SAVE)
    out = {"save": {"losses": _steps(engine, mesh, data[:K]), "dp_rank": mesh.rank_in("dp")}}
    engine.save_checkpoint(save_dir, tag="k")
    engine.destroy()
    for sp, stage in RESUMES:
        engine, gpt, mesh = _engine(sp, stage)
        engine.load_checkpoint(save_dir, tag="k")
        losses = _steps(engine, mesh, data[K:])
        with zerospeed.zero.GatheredParameters(list(gpt.parameters())):
            weights = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
        out[(sp, stage)] = {"losses": losses, "weights": weights, "dp_rank": mesh.rank_in("dp")}
        engine.destroy()
    return out


def reference(dps: list[int]):
    """One plain process; step i's loss is the mean over dps[i] replicas of their token-mean losses."""
    torch.manual_seed(0)
    gpt = GPT(WIDTH, HEADS, KV, local_sdpa)
    opt = torch.optim.Adam(gpt.parameters(), lr=LR)
    losses = [reference_step(gpt, opt, ids, labels, dp) for (ids, labels), dp in zip(batches(), dps)]
    return losses, gpt.state_dict()


@pytest.mark.timeout(300)
def test_sequence_parallel_checkpoint_resumes_at_other_sp_dp_and_stage(tmp_path):
    results = run_distributed(_ranks, WORLD, str(tmp_path), timeout=270)
    saved = WORLD // SAVE[0]
    for sp, stage in RESUMES:
        dp = WORLD // sp
        ref_losses, ref_weights = reference([saved] * K + [dp] * N)
        for rank, res in enumerate(results):
            before = [step[res["save"]["dp_rank"]] for step in ref_losses[:K]]
            assert max(abs(a - b) for a, b in zip(res["save"]["losses"], before)) <= TOL, (rank, res["save"])
            got = res[(sp, stage)]
            want = [step[got["dp_rank"]] for step in ref_losses[K:]]
            assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= TOL, (sp, stage, rank, got["losses"], want)
            for key, value in ref_weights.items():
                torch.testing.assert_close(
                    got["weights"][key],
                    value,
                    atol=TOL,
                    rtol=0,
                    msg=f"resumed at sp {sp}, ZeRO-{stage}, rank {rank}: {key}",
                )
    files = sorted(p.name for p in (tmp_path / "k").iterdir() if "optim_states" in p.name)
    assert len(files) == WORLD, files  # one ZeRO rank file per dp x sp rank
