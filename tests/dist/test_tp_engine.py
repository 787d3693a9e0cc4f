"""AutoTP switched on by the config (`"tensor_parallel": {"autotp_size": 2}`) inside `zerospeed.initialize`,
combined with data parallelism and ZeRO, against one plain PyTorch process.

4 ranks = tp 2 x dp 2. A transformers Llama (4 query / 2 kv heads, vocabulary 37: an uneven vocab split)
trains 4 AdamW steps with a gradient clip small enough to act every step, so the global norm — which
must count the replicated norms' weights once across the tensor-parallel ranks — shows in every
update. The reference: stock LlamaForCausalLM in one process, the mean of the two data-parallel
replicas' losses, torch's clip_grad_norm_ and AdamW. fp32, <= 1e-5 on losses, norms and weights, at
ZeRO stages 0-3, and through DeepSpeed's explicit route (`zerospeed.tp_model_init` before `initialize`;
without `autotp_size` in the config that is an error naming the key).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

pytest.importorskip("transformers")

V, MICRO, T, STEPS, LR, CLIP, WORLD, TP = 37, 2, 8, 4, 1e-2, 0.5, 4, 2


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def batches(dp: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (dp * MICRO, T), generator=g) for _ in range(STEPS)]


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "tensor_parallel": {"autotp_size": TP},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _train(cases):
    import zerospeed
    from zerospeed.config import ConfigError
    from zerospeed.parallel.tensor import full_state_dict

    out = {}
    for stage, route in cases:
        model = llama()
        if route == "tp_model_init":  # DeepSpeed's explicit route: shard first, then initialize
            zerospeed.tp_model_init(model, tp_size=TP, dtype=torch.float32)
            try:
                zerospeed.initialize(
                    model=model, config={k: v for k, v in _config(stage).items() if k != "tensor_parallel"}
                )
                out["missing_autotp_size"] = ""
            except ConfigError as e:
                out["missing_autotp_size"] = str(e)
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
        mesh = engine.mesh
        dp_rank = mesh.rank_in("dp")
        losses, norms = [], []
        for ids in batches(mesh.size("dp")):
            mine = ids[dp_rank * MICRO : (dp_rank + 1) * MICRO]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        with zerospeed.zero.GatheredParameters(list(model.parameters())):
            weights = full_state_dict(model, mesh.group("tp"))
        out[(stage, route)] = {
            "losses": losses,
            "norms": norms,
            "weights": weights,
            "dp_rank": dp_rank,
            "tp": mesh.size("tp"),
        }
    return out


def reference():
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for ids in batches(WORLD // TP):
        per = [
            model(input_ids=ids[d * MICRO : (d + 1) * MICRO], labels=ids[d * MICRO : (d + 1) * MICRO]).loss
            for d in range(WORLD // TP)
        ]
        opt.zero_grad()
        torch.stack(per).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append([p.item() for p in per])
    return losses, norms, model.state_dict()


@pytest.mark.timeout(300)
def test_autotp_by_config_with_dp_and_zero_matches_one_process():
    cases = [(0, "config"), (1, "config"), (2, "config"), (3, "config"), (1, "tp_model_init")]
    results = run_distributed(_train, WORLD, cases, timeout=270)
    ref_losses, ref_norms, ref_weights = reference()
    assert ref_norms[0] > CLIP  # the clip acts, so the norm enters every update
    assert 'add "tensor_parallel": {"autotp_size": 2}' in results[0]["missing_autotp_size"]
    for stage, route in cases:
        for rank, res in enumerate(results):
            got = res[(stage, route)]
            assert got["tp"] == TP
            expect = [step[got["dp_rank"]] for step in ref_losses]
            assert max(abs(a - b) for a, b in zip(got["losses"], expect)) <= 1e-5, (stage, rank, got["losses"], expect)
            assert max(abs(a - b) for a, b in zip(got["norms"], ref_norms)) <= 1e-5, (stage, got["norms"], ref_norms)
            for key, value in ref_weights.items():
                torch.testing.assert_close(
                    got["weights"][key],
                    value,
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m, key=key: f"stage {stage} rank {rank} {key}: {m}",
                )
