"""MoE layers under Ulysses sequence parallelism, against one plain PyTorch process on the full sequence.

test_ulysses_parity's GPT (GQA, DistributedAttention around SDPA, the sequence-parallel cross-entropy)
with each block's MLP a `zerospeed.moe.layer.MoE` of 4 experts (top-1, no token dropping), on 4 ranks as
sp 2 x dp 2. The expert-parallel groups split the sequence-data-parallel group (Note [expert layout] in
comm/topology.py): at ep 2 the two sequence ranks of a replica hold 2 experts each, at ep 4 every rank
holds one; the experts' gradients average over their replicas as dense weights do over dp x sp. Trained
10 Adam steps at ZeRO-2 (ep 2) and ZeRO-0 (ep 4).

The reference runs the same blocks with the experts computed densely per token (harness.
moe_reference.ref_moe_forward: softmax gate, the top expert's output times its gate), the whole
sequence in one process, each step's loss the mean over the 2 replicas (test_ulysses_parity.
reference_step). The router's auxiliary loss is left out of the objective (it is a per-rank statistic
of the tokens a rank holds, which a sequence split changes by design). Every rank's loss and every
weight — dense, gate and each rank's experts by their global index — within 1e-5. At ZeRO-2 a checkpoint
saved 2 steps before the end and loaded by a fresh engine takes those 2 steps to the same losses.
"""

from __future__ import annotations

import pytest
import torch
from test_ulysses_parity import MICRO, SPLoss, batches, reference_step, sp_steps
from torch import nn

import zerospeed
from harness import run_distributed
from harness.moe_reference import ref_moe_forward
from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zerospeed.sequence.layer import DistributedAttention
from zoo.sequence_models import GPT, local_sdpa

WORLD, SP, E, WIDTH, HEADS, KV, LR, TOL = 4, 2, 4, 16, 4, 2, 1e-2, 1e-5
CASES = [(2, 2), (4, 0)]  # (ep, ZeRO stage)


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def expert_values(layer: int, e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * layer + e)
    return [torch.randn(p.shape, generator=g) * 0.3 for p in expert().parameters()]


def gate_values(layer: int) -> torch.Tensor:
    return torch.randn(E, WIDTH, generator=torch.Generator().manual_seed(7 + layer))


class MoEMLP(nn.Module):
    """The block's MLP as DeepSpeed's MoE layer; this rank's experts start from their global values."""

    def __init__(self, layer: int, ep: int, ep_rank: int):
        super().__init__()
        self.moe = MoE(
            WIDTH,
            expert(),
            num_experts=E,
            ep_size=ep,
            k=1,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(gate_values(layer))
            for j, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for p, v in zip(ex.parameters(), expert_values(layer, ep_rank * (E // ep) + j)):
                    p.copy_(v)

    def forward(self, x):
        return self.moe(x)[0]


class DenseMoEMLP(nn.Module):
    """The reference: every expert here, each token through its top expert (moe_reference)."""

    def __init__(self, layer: int):
        super().__init__()
        self.gate = nn.Parameter(gate_values(layer))
        self.experts = nn.ModuleList(expert() for _ in range(E))
        with torch.no_grad():
            for e, ex in enumerate(self.experts):
                for p, v in zip(ex.parameters(), expert_values(layer, e)):
                    p.copy_(v)

    def forward(self, x):
        out = ref_moe_forward(x.reshape(-1, WIDTH), self.gate, list(self.experts), k=1, cap=None)[0]
        return out.reshape(x.shape)


def _build(ep: int, stage: int):
    box = {}
    torch.manual_seed(0)
    gpt = GPT(WIDTH, HEADS, KV, lambda q, k, v: box["attn"](q, k, v, batch_dim_idx=0))
    mesh = zerospeed.comm.ParallelMesh.build(sp=SP)
    box["attn"] = DistributedAttention(local_sdpa, mesh.group("sp"))
    ep_rank = mesh.expert_axes(ep)[0].rank
    for i, block in enumerate(gpt.blocks):
        block.mlp = MoEMLP(i, ep, ep_rank)
    model = SPLoss(gpt, mesh.group("sp"))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "sequence_parallel_size": SP,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 256},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg, mesh=mesh)
    return engine, gpt, mesh, ep_rank


def _train(ep: int, stage: int, save_dir: str) -> dict:
    engine, gpt, mesh, ep_rank = _build(ep, stage)
    data = batches(mesh.size("dp"))
    losses = sp_steps(engine, mesh, data[:-2], MICRO)
    if stage > 0:  # a checkpoint taken 2 steps before the end, resumed by a fresh engine, takes the same 2 steps
        engine.save_checkpoint(save_dir, tag="moe_sp")
        resumed, _, resumed_mesh, _ = _build(ep, stage)
        resumed.load_checkpoint(save_dir, tag="moe_sp")
        resumed_last = sp_steps(resumed, resumed_mesh, data[-2:], MICRO)  # (the 2nd loss needs Adam's state back)
        resumed.destroy()
    losses += sp_steps(engine, mesh, data[-2:], MICRO)
    dp_rank = mesh.rank_in("dp")
    with zerospeed.zero.GatheredParameters(list(gpt.parameters())):
        dense = {k: v.detach().clone() for k, v in gpt.state_dict().items() if ".deepspeed_experts." not in k}
        experts = {
            (i, ep_rank * (E // ep) + j): [p.detach().clone() for p in ex.parameters()]
            for i, b in enumerate(gpt.blocks)
            for j, ex in enumerate(b.mlp.moe.deepspeed_moe.experts.deepspeed_experts)
        }
    engine.destroy()
    return {
        "losses": losses,
        "dense": dense,
        "experts": experts,
        "dp_rank": dp_rank,
        "ep_group": list(mesh.expert_axes(ep)[0].members),
        "resumed_last": resumed_last if stage > 0 else None,
    }


def _runs(save_dir: str) -> dict:
    return {case: _train(*case, f"{save_dir}/{case[0]}_{case[1]}") for case in CASES}


def reference():
    torch.manual_seed(0)
    gpt = GPT(WIDTH, HEADS, KV, local_sdpa)
    for i, block in enumerate(gpt.blocks):
        block.mlp = DenseMoEMLP(i)
    opt = torch.optim.Adam(gpt.parameters(), lr=LR)
    dp = WORLD // SP
    losses = [reference_step(gpt, opt, ids, labels, dp) for ids, labels in batches(dp)]
    return losses, gpt


@pytest.mark.timeout(300)
def test_moe_under_sequence_parallelism_matches_one_process(tmp_path):
    results = run_distributed(_runs, WORLD, str(tmp_path), timeout=270)
    ref_losses, ref = reference()
    ref_state = ref.state_dict()
    for ep, stage in CASES:
        # ep 2: each replica's two sequence ranks form an expert-parallel group
        assert results[0][(ep, stage)]["ep_group"] == ([0, 1] if ep == 2 else [0, 1, 2, 3])
        for rank, res in enumerate(results):
            got = res[(ep, stage)]
            want = [step[got["dp_rank"]] for step in ref_losses]
            assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= TOL, (ep, stage, rank, got["losses"], want)
            if got["resumed_last"] is not None:  # checkpoint (experts named globally, files per dp x sp rank)
                assert got["resumed_last"] == pytest.approx(got["losses"][-2:], abs=TOL), (ep, stage, rank)
            for key, value in got["dense"].items():
                ref_key = key.replace("mlp.moe.deepspeed_moe.gate.wg.weight", "mlp.gate")
                torch.testing.assert_close(
                    value, ref_state[ref_key], atol=TOL, rtol=0, msg=f"ep {ep} ZeRO-{stage} rank {rank}: {key}"
                )
            for (layer, e), values in got["experts"].items():
                for v, r in zip(values, ref.blocks[layer].mlp.experts[e].parameters()):
                    torch.testing.assert_close(
                        v,
                        r.detach(),
                        atol=TOL,
                        rtol=0,
                        msg=f"ep {ep} ZeRO-{stage} rank {rank}: layer {layer} expert {e}",
                    )
