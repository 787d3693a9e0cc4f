"""AutoEP by config alone against stock transformers in one plain process.

Four ranks, `"expert_parallel": {"enabled": true, "autoep_size": 2}`: ep 2 x expert-dp 2, each rank
holding 2 of the 4 experts of every MoE block. Models: a tiny Mixtral (hidden 32, 4 experts, top-2,
2 layers) at ZeRO-2 and ZeRO-3, a tiny Qwen3-MoE (preset "qwen3_moe", renormalisation off) at
ZeRO-2, and a Qwen2-MoE (found by shape: a shared expert, a dense second layer) at ZeRO-3; `output_router_logits`
on, so each replica's loss carries transformers' own router aux loss.
The reference is the stock model on the same global batches: per step, the mean of the 4
replicas' losses (what DDP averages), one AdamW step with a gradient clip that acts. Compared:
every replica's loss at every step, and the final weights — written by `save_autoep_model` in
transformers' own format and loaded by the stock `from_pretrained`, with no zerospeed involved.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import zerospeed
from harness import run_distributed
from zerospeed import comm
from zerospeed.moe.autoep import ExpertParallelExperts, save_autoep_model

transformers = pytest.importorskip("transformers")

WORLD, B, T, STEPS, VOCAB = 4, 2, 8, 10, 64
LR, CLIP, TOL = 1e-2, 0.5, 1e-5
CASES = [("mixtral", 2), ("mixtral", 3), ("qwen3_moe", 2), ("qwen2_moe", 3)]
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def build(family: str):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.05,
    }
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                intermediate_size=32,
                moe_intermediate_size=16,
                num_experts=4,
                norm_topk_prob=False,
                head_dim=8,
                **common,
            )
        )
    # a shared expert; layer 1 dense. No qkv bias: a key bias has no gradient in exact arithmetic (softmax is
    # shift-invariant), so Adam turns its rounding noise into lr-sized steps that differ between any two runs.
    return transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            mlp_only_layers=[1],
            qkv_bias=False,
            **common,
        )
    )


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (WORLD * B, T), generator=g) for _ in range(STEPS)]


def config(family: str, stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 2048}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    ep = {"enabled": True, "autoep_size": 2}
    if family == "qwen3_moe":
        ep.update(preset_model="qwen3_moe", route_norm=False)
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "expert_parallel": ep,
    }


def _train(family: str, stage: int, out: str) -> dict:
    rank = comm.get_rank()
    model = build(family)
    engine, *_ = zerospeed.initialize(model=model, config=config(family, stage))
    local = [(m.first_expert, m.num_local_experts) for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    losses, aux = [], []
    comm.STATS.reset()
    for ids in batches():
        mine = ids[rank * B : (rank + 1) * B]
        result = engine(input_ids=mine, labels=mine)
        engine.backward(result.loss)
        engine.step()
        losses.append(result.loss.item())
        aux.append(result.aux_loss.item())
    a2a = comm.STATS.snapshot().get("all_to_all", {"calls": 0})["calls"]
    wire, counts = _forward_bytes(engine, model, batches()[0][rank * B : (rank + 1) * B])
    save_autoep_model(engine, out)
    engine.zero.remove_hooks()
    return {
        "losses": losses,
        "aux": aux,
        "local": local,
        "a2a_calls": a2a,
        "wire": wire,
        "counts": counts,
        "ep_members": engine.mesh.expert_axes(2)[0].members,
    }


def _forward_bytes(engine, model, ids) -> tuple[float, list[list[int]]]:
    """All-to-all wire bytes of one forward, and the pairs each block routed to each expert."""
    seen = []
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out: seen.append(torch.bincount(args[1].reshape(-1), minlength=4).tolist())
        )
        for m in model.modules()
        if isinstance(m, ExpertParallelExperts)
    ]
    comm.STATS.reset()
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    return comm.STATS.snapshot()["all_to_all"]["wire_bytes"], seen


def expected_bytes(results: list, case, rank: int) -> float:
    """docs/moe.md (AutoEP): per block, the pairs leaving the rank and the pairs its experts serve for
    the other rank of its expert-parallel group, H fp32 values each, plus the E int64 counts (half leave)."""
    me, total = results[rank][case], 0.0
    ep_rank = me["ep_members"].index(rank)
    for block, counts in enumerate(me["counts"]):
        mine = range(ep_rank * 2, ep_rank * 2 + 2)
        away = sum(n for e, n in enumerate(counts) if e not in mine)
        back = sum(results[r][case]["counts"][block][e] for r in me["ep_members"] if r != rank for e in mine)
        total += (away + back) * 32 * 4 + 4 * 8 / 2
    return total


def _all_cases(root: str) -> dict:
    return {case: _train(*case, out=str(Path(root) / f"{case[0]}_{case[1]}")) for case in CASES}


@functools.cache  # Mixtral's serves two cases
def reference(family: str, steps: int = STEPS) -> tuple[list[list[float]], dict]:
    """Each replica's loss at each of the first `steps` steps, and the weights after them."""
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = [[] for _ in range(WORLD)]
    for ids in batches()[:steps]:
        opt.zero_grad()
        total = 0.0
        for r in range(WORLD):
            mine = ids[r * B : (r + 1) * B]
            loss = model(input_ids=mine, labels=mine).loss
            total = total + loss / WORLD
            losses[r].append(loss.item())
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return losses, model.state_dict()


@pytest.mark.timeout(200)
def test_autoep_matches_stock_transformers(tmp_path):
    results = run_distributed(_all_cases, WORLD, str(tmp_path), timeout=180)
    for case in CASES:
        family, stage = case
        ref_losses, ref_state = reference(family)
        for r in range(WORLD):
            got = results[r][case]
            assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses[r])) <= TOL, (case, r)
            assert min(got["aux"]) > 0.5  # the router aux loss is in the loss (E * sum(f * P) ~ 1 here)
            # 2 of 4 experts per block; 2 exchanges (+ the counts) per block forward, their conjugates in backward
            assert all(n == 2 for _, n in got["local"]) and got["a2a_calls"] >= STEPS * 4 * len(got["local"])
            assert got["wire"] == expected_bytes(results, case, r), (case, r)
        firsts = {first for r in range(WORLD) for first, _ in results[r][case]["local"]}
        assert firsts == {0, 2}, case  # the two expert-parallel halves cover all 4 experts
        cls = getattr(transformers, CLASSES[family])
        plain, info = cls.from_pretrained(tmp_path / f"{family}_{stage}", output_loading_info=True)
        assert not any(info.values()), (case, info)
        state = plain.state_dict()
        assert state.keys() == ref_state.keys(), case
        worst = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        assert worst <= TOL, (case, worst)
