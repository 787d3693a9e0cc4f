"""MoE checkpoints: save at ep 2 x expert-dp 2 (ZeRO-2, 4 ranks) after 5 of 10 steps, load at ep 4
(ZeRO-2) and at ep 1 x dp 4 (ZeRO-3) — and a ZeRO-0 save (whole states: each expert written by one
replica) loaded at ep 4 — and continue exactly like the uninterrupted dense reference
of tests/dist/test_moe_parity.py. The checkpoint names experts globally (Note [global expert names]
in zerospeed/checkpoint/experts.py): DeepSpeed's per-expert files, and a consolidated state dict
that is the same model's at ep 1.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from test_moe_parity import (  # tests/dist is on sys.path
    STEPS,
    WORLD,
    B,
    E,
    Net,
    batches,
    config,
    reference,
)

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

K, DROP, HALF = 1, True, STEPS // 2
TARGETS = [(2, 4, 2), (2, 1, 3), (0, 4, 0)]  # (ZeRO stage saved at, ep and stage resumed at)


def _engine(ep: int, stage: int):
    mesh = ParallelMesh.build(ep=ep)
    net = Net(ep, K, DROP, mesh.rank_in("ep"))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
    engine, *_ = zerospeed.initialize(model=net, model_parameters=groups, config=config(stage), mesh=mesh)
    return engine, net, mesh


def _steps(engine, todo):
    rank, losses = comm.get_rank(), []
    for x, y in todo:
        loss, _ = engine(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_and_resume(root: str):
    out = {}
    for saved_stage in (2, 0):
        engine, _, _ = _engine(2, saved_stage)
        out["first", saved_stage] = _steps(engine, batches()[:HALF])
        engine.save_checkpoint(root, tag=f"half{saved_stage}")
    out["files"] = sorted(p.name for p in (Path(root) / "half2").iterdir())
    out["consolidated"] = get_fp32_state_dict_from_zero_checkpoint(root, tag="half2") if comm.get_rank() == 0 else None
    for saved_stage, ep, stage in TARGETS:
        engine, net, mesh = _engine(ep, stage)
        engine.load_checkpoint(root, tag=f"half{saved_stage}")
        rest = _steps(engine, batches()[HALF:])
        with zerospeed.zero.GatheredParameters(list(net.parameters())):
            experts = [
                [p.detach().clone() for p in ex.parameters()] for ex in net.moe.deepspeed_moe.experts.deepspeed_experts
            ]
            gate = net.moe.deepspeed_moe.gate.wg.weight.detach().clone()
        out[saved_stage, ep, stage] = {"losses": rest, "experts": experts, "gate": gate, "ep_rank": mesh.rank_in("ep")}
    return out


@pytest.mark.timeout(180)
def test_save_at_ep2_resume_at_ep4_and_ep1():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_save_and_resume, WORLD, root, timeout=160)
    ref_losses, _, _, ref_dense, ref_experts = reference(K, DROP)
    _, _, _, half_dense, half_experts = reference(K, DROP, steps=HALF)
    for rank, r in enumerate(results):
        for saved_stage in (2, 0):
            assert max(abs(a - b) for a, b in zip(r["first", saved_stage], ref_losses[rank][:HALF])) <= 1e-5
        for saved_stage, ep, stage in TARGETS:
            got = r[saved_stage, ep, stage]
            gap = max(abs(a - b) for a, b in zip(got["losses"], ref_losses[rank][HALF:]))
            assert gap <= 1e-5, (
                f"saved at stage {saved_stage}, resumed at ep {ep} stage {stage}, rank {rank}: max |dloss| {gap:.2e}"
            )
            torch.testing.assert_close(got["gate"], ref_dense[2], rtol=0, atol=1e-5)
            local = E // ep
            for j, expert in enumerate(got["experts"]):
                for a, b in zip(expert, ref_experts[got["ep_rank"] * local + j]):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"ep {ep} rank {rank} expert {j}")
    files = results[0]["files"]
    assert [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" in files for e in range(E)] == [True] * E
    # consolidated: every expert under its global index, the state dict of the same model at ep 1
    sd = results[0]["consolidated"]
    model = Net(1, K, DROP, 0)
    model.load_state_dict(sd, strict=True)
    torch.testing.assert_close(model.moe.deepspeed_moe.gate.wg.weight, half_dense[2], rtol=0, atol=1e-6)
    for e, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
        for a, b in zip(expert.parameters(), half_experts[e]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
