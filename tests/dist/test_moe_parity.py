"""MoE with expert parallelism against one plain PyTorch process running the same experts densely.

Four ranks, a tiny model (dense Linear -> MoE of 4 experts -> loss = MSE + 0.1 * l_aux), 10 AdamW
steps with a gradient clip that acts. Cases: top-1 and top-2, with and without token dropping, at
ep = 1, 2, 4 (ZeRO-0), and ep 2 x expert-dp 2 at ZeRO-2 and ZeRO-3 — all through
`zerospeed.initialize` with DeepSpeed-style param groups. The reference
(harness.moe_reference) routes each virtual rank's own tokens with per-token loops
(capacity is per rank, as in DeepSpeed), holds one copy of each of the 4 experts, and descends the
mean of the 4 ranks' losses. Gating is deterministic here (no RTS, no second-expert sampling, no
noise); the random parts are tested by their properties in tests/unit/test_moe_gating.py.

The same processes also count the all-to-all bytes of a forward (docs/moe.md): per MoE layer,
2 exchanges of the [E, C, M] slot buffer, each sending (ep - 1) / ep of it — or, dropless, only the
routed tokens that leave the rank.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zerospeed
from harness import live_tensor_bytes, run_distributed
from harness.moe_reference import ref_capacity, ref_l_aux, ref_routes
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zerospeed.zero.memory import model_state_bytes

WORLD, E, M, H, B, T, STEPS = 4, 4, 6, 5, 2, 4, 10
LR, CLIP, AUX = 2e-2, 0.2, 0.1
ZERO0 = [(ep, k, drop, 0) for ep in (1, 2, 4) for k in (1, 2) for drop in (True, False)]
SHARDED = [(2, 1, True, 2), (2, 2, False, 3)]  # ep 2 x expert-dp 2; the census below covers both stages too
CASES = ZERO0 + SHARDED


def expert_module() -> nn.Module:
    return nn.Sequential(nn.Linear(M, H), nn.Tanh(), nn.Linear(H, M))


def expert_values(e: int) -> list[torch.Tensor]:
    """Global expert e's starting weights (distinct per expert; DeepSpeed would start them equal)."""
    g = torch.Generator().manual_seed(100 + e)
    return [torch.randn(p.shape, generator=g) * 0.5 for p in expert_module().parameters()]


def gate_values() -> torch.Tensor:
    return torch.randn(E, M, generator=torch.Generator().manual_seed(7))


class Net(nn.Module):
    def __init__(self, ep: int, k: int, drop: bool, ep_rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(M, M)
        self.moe = MoE(
            M,
            expert_module(),
            num_experts=E,
            ep_size=ep,
            k=k,
            min_capacity=0,
            drop_tokens=drop,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        local = E // ep
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(gate_values())
            for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for p, v in zip(expert.parameters(), expert_values(ep_rank * local + j)):
                    p.copy_(v)

    def forward(self, x, y):
        out, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return (out - y).pow(2).mean() + AUX * l_aux, l_aux


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(WORLD * B, T, M, generator=g), torch.randn(WORLD * B, T, M, generator=g)) for _ in range(STEPS)
    ]


def config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 64}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _train(ep, k, drop, stage):
    rank = comm.get_rank()
    mesh = ParallelMesh.build(ep=ep)
    net = Net(ep, k, drop, mesh.rank_in("ep"))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
    engine, *_ = zerospeed.initialize(model=net, model_parameters=groups, config=config(stage), mesh=mesh)
    losses, auxes, norms = [], [], []
    for x, y in batches():
        loss, l_aux = engine(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        auxes.append(l_aux.item())
        norms.append(engine.get_global_grad_norm())
    with zerospeed.zero.GatheredParameters(list(net.parameters())):
        layer = net.moe.deepspeed_moe
        dense = [p.detach().clone() for p in net.inp.parameters()] + [layer.gate.wg.weight.detach().clone()]
        experts = [[p.detach().clone() for p in ex.parameters()] for ex in layer.experts.deepspeed_experts]
    # all-to-all bytes of one forward
    comm.STATS.reset()
    with torch.no_grad():
        engine(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B])
    a2a = comm.STATS.snapshot().get("all_to_all", {"calls": 0, "wire_bytes": 0.0})
    return {
        "losses": losses,
        "aux": auxes,
        "norms": norms,
        "dense": dense,
        "experts": experts,
        "ep_rank": mesh.rank_in("ep"),
        "a2a": (a2a["calls"], a2a["wire_bytes"]),
        "counts": net.moe.deepspeed_moe.exp_counts.tolist(),
        "ep_members": mesh.members("ep"),
    }


def _census(stage: int) -> dict:
    """Live tensor bytes (independent census) an ep 2 x expert-dp 2 engine holds after a step, with
    experts 98% of the parameters; the per-rank parameter counts of the dense and expert groups."""
    gc.collect()
    baseline = live_tensor_bytes()
    rank, wide = comm.get_rank(), 32
    mesh = ParallelMesh.build(ep=2)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(wide, wide),
        MoE(
            wide,
            nn.Sequential(nn.Linear(wide, 512), nn.Linear(512, wide)),
            num_experts=E,
            ep_size=2,
            min_capacity=0,
            use_rts=False,
        ),
    )
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
    sizes = [sum(p.numel() for p in g["params"]) for g in groups]
    engine, *_ = zerospeed.initialize(model=net, model_parameters=groups, config=config(stage), mesh=mesh)
    x = torch.randn(B * T, wide, generator=torch.Generator().manual_seed(rank))
    out, l_aux, _ = engine(x)
    engine.backward(out.pow(2).mean() + l_aux)
    engine.step()
    del x, out, l_aux
    gc.collect()
    measured = live_tensor_bytes() - baseline
    predicted = sum(engine.memory_breakdown()["predicted"].values())
    engine.zero.remove_hooks()
    return {"measured": measured, "predicted": predicted, "dense": sizes[0], "experts": sizes[1]}


def _all_cases():
    out = {case: _train(*case) for case in CASES}
    out["census"] = {stage: _census(stage) for stage in (2, 3)}
    return out


def reference(k: int, drop: bool, steps: int = STEPS):
    """Per step: each virtual rank's loss and l_aux, the clip norm; the final dense and expert weights
    (after `steps` steps)."""
    torch.manual_seed(0)
    inp = nn.Linear(M, M)
    wg = nn.Linear(M, E, bias=False)
    with torch.no_grad():
        wg.weight.copy_(gate_values())
    experts = [expert_module() for _ in range(E)]
    for e, ex in enumerate(experts):
        with torch.no_grad():
            for p, v in zip(ex.parameters(), expert_values(e)):
                p.copy_(v)
    params = list(inp.parameters()) + [wg.weight] + [p for ex in experts for p in ex.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses, auxes, norms = [[] for _ in range(WORLD)], [[] for _ in range(WORLD)], []
    for x, y in batches()[:steps]:
        opt.zero_grad()
        total = 0.0
        for r in range(WORLD):
            h = torch.tanh(inp(x[r * B : (r + 1) * B])).reshape(-1, M)
            logits = h @ wg.weight.t()
            cap = ref_capacity(h.shape[0], E, 1.0 * k, 0) if drop else None
            routes, choices = ref_routes(logits, k, cap)
            l_aux = ref_l_aux(logits, choices, k)
            out = torch.stack(
                [
                    sum((w * experts[e](h[s : s + 1])[0] for e, w in routes[s]), torch.zeros(M))
                    for s in range(h.shape[0])
                ]
            )
            loss = (out.reshape(B, T, M) - y[r * B : (r + 1) * B]).pow(2).mean() + AUX * l_aux
            total = total + loss / WORLD
            losses[r].append(loss.item())
            auxes[r].append(l_aux.item())
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
    dense = [p.detach() for p in inp.parameters()] + [wg.weight.detach()]
    return losses, auxes, norms, dense, [[p.detach() for p in ex.parameters()] for ex in experts]


def _forward_bytes(k: int, drop: bool, ep: int, rank: int, results: list) -> float:
    """Forward all-to-all wire bytes of one rank. Dropping: two exchanges of the whole slot buffer,
    2 x E x C x M x 4 x (ep - 1) / ep. Dropless (Note [dropless exchange]): this rank's routed tokens
    whose experts live elsewhere, the outputs of other ranks' tokens for its own experts on the way
    back, and the E int64 counts ((ep - 1) / ep of them leave)."""
    if drop:
        return 2 * E * ref_capacity(B * T, E, 1.0 * k, 0) * M * 4 * (ep - 1) / ep
    local, me = E // ep, results[rank]
    away = sum(n for e, n in enumerate(me["counts"]) if e // local != me["ep_rank"])
    mine = range(me["ep_rank"] * local, (me["ep_rank"] + 1) * local)
    back = sum(results[r]["counts"][e] for r in me["ep_members"] if r != rank for e in mine)
    return (away + back) * M * 4 + E * 8 * (ep - 1) / ep


@pytest.mark.timeout(240)
def test_moe_matches_dense_reference():
    results = run_distributed(_all_cases, WORLD, timeout=220)
    refs = {(k, drop): reference(k, drop) for k in (1, 2) for drop in (True, False)}
    for case in CASES:
        ep, k, drop, _ = case
        ref_losses, ref_aux, ref_norms, ref_dense, ref_experts = refs[(k, drop)]
        for rank, res in enumerate(results):
            r = res[case]
            gap = max(abs(a - b) for a, b in zip(r["losses"], ref_losses[rank]))
            assert gap <= 1e-5, f"{case} rank {rank}: max |dloss| {gap:.2e}"
            gap = max(abs(a - b) for a, b in zip(r["aux"], ref_aux[rank]))
            assert gap <= 1e-5, f"{case} rank {rank}: max |dl_aux| {gap:.2e}"
            gap = max(abs(a - b) for a, b in zip(r["norms"], ref_norms))
            assert gap <= 1e-5, f"{case} rank {rank}: max |dnorm| {gap:.2e}"
            for got, want in zip(r["dense"], ref_dense):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{case} rank {rank} dense")
            local = E // ep
            for j, got_expert in enumerate(r["experts"]):
                for got, want in zip(got_expert, ref_experts[r["ep_rank"] * local + j]):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{case} rank {rank} expert {j}")
            calls, wire = r["a2a"]
            assert calls == (0 if ep == 1 else 2 if drop else 3), (case, calls)
            if ep > 1:
                assert sum(r["counts"]) == k * B * T
                assert wire == _forward_bytes(k, drop, ep, rank, [res[case] for res in results]), (case, wire)
    # the clip acted and experts moved apart: the comparisons were not vacuous
    assert all(max(ref[2]) > CLIP for ref in refs.values())
    assert not torch.allclose(refs[(1, True)][4][0][0], refs[(1, True)][4][1][0])
    check_census(results)


def check_census(results):
    """Model states per rank = dense over dp (4) + this rank's experts (E / ep = 2) over expert-dp (2),
    fp32 AdamW: 4 (weights) + 4 (gradients) + 8 (states) bytes per parameter, split by stage."""
    for stage in (2, 3):
        for rank, res in enumerate(results):
            c = res["census"][stage]
            per = {"param_bytes": 4, "grad_bytes": 4, "master_bytes": 0, "optim_bytes": 8}
            dense = model_state_bytes(c["dense"], WORLD, stage, **per)
            experts = model_state_bytes(c["experts"], 2, stage, **per)
            formula = sum(dense.values()) + sum(experts.values())
            assert c["experts"] > 40 * c["dense"]
            assert c["predicted"] == formula, (stage, c)
            assert abs(c["measured"] - formula) <= 1e-3 * formula, (stage, rank, c, formula)
            # the wrong layouts would be far off: experts sharded over all 4 ranks, or all 4 experts held
            wrong = sum(dense.values()) + sum(model_state_bytes(c["experts"], WORLD, stage, **per).values())
            assert abs(c["measured"] - wrong) > 0.1 * formula
