"""A transformers Llama (GQA) under Ulysses by registration alone, against transformers itself.

The reference is one process running the stock `LlamaForCausalLM` (sdpa) on the full right-padded
batch with its attention mask and `labels`, i.e. transformers' own loss. The sharded run registers
`UlyssesSPAttentionHF` for the same model, feeds each rank its slice (`shard_sequence_batch`: global
position ids, labels shifted before sharding, length 13 padded to a multiple of the degree) and trains
through `zerospeed.initialize(..., mpu=mpu)`. 4 query / 2 kv heads: at sp = 4 each kv head goes to two
ranks. fp32, 4 steps, <= 1e-5 on every loss and on the final weights.
"""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import run_distributed

SEQ, MICRO, STEPS, LR, WD, TOL = 13, 2, 4, 1e-3, 0.01, 1e-5


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def mixtral():
    """A Mixtral (4 experts, top-2) with the same attention as `llama`; no router aux loss, a per-rank
    statistic of the rank's tokens that no sequence split leaves unchanged."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return MixtralForCausalLM(cfg)


def build(ep: int):
    return mixtral() if ep else llama()


def batches(dp: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, 64, (dp * MICRO, SEQ), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=g) < 0.15] = -100
        for row in range(ids.shape[0]):
            pad = int(torch.randint(0, 6, (), generator=g))
            if pad:
                ids[row, SEQ - pad :], mask[row, SEQ - pad :], labels[row, SEQ - pad :] = 0, 0, -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _train(sp: int, stage: int, tiles: int = 1, ep: int = 0):
    """`ep`: a Mixtral with AutoEP over `ep` ranks of the sequence-data-parallel group (Note [expert
    layout]); 0: the Llama."""
    from zerospeed.moe.autoep import consolidated_state_dict
    from zerospeed.sequence.data import shard_sequence_batch
    from zerospeed.sequence.hf import UlyssesSPAttentionHF, enable_tiled_mlp, install_sequence_parallel_loss

    model = build(ep)
    if tiles > 1:  # ALST's tiled MLP (at ZeRO-3: Note [tiled compute under ZeRO-3])
        enable_tiled_mlp(model, tiles)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, MICRO)
    try:
        install_sequence_parallel_loss(model, mpu.get_sequence_parallel_group())
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "gradient_accumulation_steps": 1,
            "sequence_parallel_size": sp,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        if ep:
            cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
        engine, *_ = zerospeed.initialize(model=model, config=cfg, mpu=mpu)
        dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        sp_rank = mpu.get_sequence_parallel_rank()
        losses = []
        for batch in batches(dp):
            mine = {k: v[dp_rank * MICRO : (dp_rank + 1) * MICRO] for k, v in batch.items()}
            shard = shard_sequence_batch(mine, sp_rank, sp)
            loss = engine(**shard).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with zerospeed.zero.GatheredParameters(list(model.parameters())):  # every expert (AutoEP)
            weights = {k: v.detach().clone() for k, v in consolidated_state_dict(model).items()}
        return {"losses": losses, "weights": weights, "dp_rank": dp_rank}
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()


def _runs(cases):
    return {case: _train(*case) for case in cases}


def _check(results, cases):
    for case in cases:
        sp, stage = case[:2]
        ref_losses, ref_weights = reference(4 // sp, case[3] if len(case) > 3 else 0)
        for rank, res in enumerate(results):
            got = res[case]
            expect = [step[got["dp_rank"]] for step in ref_losses]
            diff = max(abs(a - b) for a, b in zip(got["losses"], expect))
            assert diff <= TOL, (case, rank, got["losses"], expect)
            for key, value in ref_weights.items():
                torch.testing.assert_close(
                    got["weights"][key],
                    value,
                    atol=TOL,
                    rtol=0,
                    msg=lambda m, key=key: f"{case} rank {rank} {key}: {m}",
                )


def reference(dp: int, ep: int = 0):
    model = build(ep)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for batch in batches(dp):
        per = [model(**{k: v[d * MICRO : (d + 1) * MICRO] for k, v in batch.items()}).loss for d in range(dp)]
        opt.zero_grad()
        torch.stack(per).mean().backward()
        opt.step()
        losses.append([p.item() for p in per])
    return losses, model.state_dict()


@pytest.mark.timeout(400)
def test_llama_gqa_by_registration_matches_transformers():
    # (sp, ZeRO stage[, MLP tiles]) on 4 ranks: sp 4; sp 2 x dp 2; the last with ALST's tiled MLP at ZeRO-3
    cases = [(4, 0), (2, 1), (2, 3), (2, 3, 3)]
    _check(run_distributed(_runs, 4, cases, timeout=360), cases)


@pytest.mark.timeout(300)
def test_mixtral_with_autoep_under_ulysses_matches_transformers():
    # (sp, ZeRO stage, MLP tiles, AutoEP size) on 4 ranks, sp 2 x dp 2: expert groups of 2 and of 4 ranks
    # split the 4 sequence-data-parallel ranks, so an expert serves tokens of both halves of a sequence
    cases = [(2, 2, 1, 2), (2, 3, 1, 4)]
    _check(run_distributed(_runs, 4, cases, timeout=270), cases)
