"""The hybrid engine (`hybrid_engine.enabled`, runtime/hybrid_engine.py) on 2 ranks: generate, then train, with
one engine, against transformers' own `generate` and a plain PyTorch training run.

At ZeRO-3 (persistence threshold 0, so every unit is really partitioned):
- with `pin_parameters` (Note [pinned generation]), each rank greedy-generates from its own prompts and
  gets transformers' tokens for them on the whole model. The ranks ask for different lengths (3 and 7
  new tokens): pinned generation runs no collective per token, so they need not stay in step. The
  gathering collectives during generation, counted by the comm gateway, are the same few (at most 2)
  for either length;
- without pinning, the same tokens at equal lengths, and the gathers grow with the tokens (the
  per-module hooks gather for every forward);
- after generating, two training steps equal plain AdamW on the whole model over the same global
  batches (losses and weights within 1e-5): generation left the training state alone, and every
  unit is released afterwards (no parameter element stays gathered).
At ZeRO-2 the weights are whole already: the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import reference_train

V, WORLD, MICRO = 61, 2, 2
NEW = {0: 3, 1: 7}
ADAMW = {"lr": 1e-3, "weight_decay": 0.0}


def make():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def prompts(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randint(2, V, (2, 5), generator=g)


def batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(2, V, (WORLD * MICRO, 8), generator=g),) for _ in range(2)]


def _generate(engine, rank: int, new: int):
    from zerospeed import comm

    before = comm.STATS.snapshot()
    with torch.no_grad():
        out = engine.generate(prompts(rank), max_new_tokens=new, do_sample=False)
    after = comm.STATS.snapshot()
    gathers = sum(after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after if "gather" in k)
    return out, gathers


def _run(stage: int, pin: bool, equal_lengths: bool):
    import zerospeed
    from zerospeed import comm

    model = make()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "pin_parameters": pin},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank = comm.get_rank()
    engine.eval()
    tokens, gathers = _generate(engine, rank, NEW[0] if equal_lengths else NEW[rank])
    gathered_after = sum(p.numel() for p in model.parameters())  # stage 3: 0 once every unit is released
    engine.train()
    losses = []
    for (ids,) in batches():
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean, op="avg")
        losses.append(mean.item())
    engine.eval()  # (logs the round's time split)
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "tokens": tokens,
        "gathers": gathers,
        "gathered_after": gathered_after,
        "losses": losses,
        "weights": weights,
        "type": type(engine).__name__,
    }


def _runs():
    return {"pinned": _run(3, True, False), "unpinned": _run(3, False, True), "zero2": _run(2, True, False)}


@pytest.mark.timeout(240)
def test_hybrid_engine_generates_transformers_tokens_then_trains_like_plain_pytorch():
    results = run_distributed(_runs, WORLD, timeout=200)
    model = make().eval()
    want = {
        (r, n): model.generate(prompts(r), max_new_tokens=n, do_sample=False)
        for r in range(WORLD)
        for n in set(NEW.values())
    }
    trained = make()
    ref = reference_train(
        trained,
        torch.optim.AdamW(trained.parameters(), **ADAMW),
        batches(),
        world_size=WORLD,
        grad_accum=1,
        loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss,
    )
    for rank, res in enumerate(results):
        for name, new in (("pinned", NEW[rank]), ("unpinned", NEW[0]), ("zero2", NEW[rank])):
            got = res[name]
            assert got["type"] == "DeepSpeedHybridEngine"
            assert torch.equal(got["tokens"], want[rank, new]), (rank, name, got["tokens"], want[rank, new])
            assert max(abs(a - b) for a, b in zip(got["losses"], ref)) <= 1e-5, (rank, name, got["losses"], ref)
            for key, value in trained.state_dict().items():
                torch.testing.assert_close(got["weights"][key], value, atol=1e-5, rtol=0, msg=f"{rank} {name} {key}")
        # pinned: the same few collectives (the gather of every unit, with its divergence code) for 3 or 7 tokens
        assert res["pinned"]["gathers"] == results[0]["pinned"]["gathers"] <= 2, res["pinned"]["gathers"]
        assert res["unpinned"]["gathers"] >= NEW[0] + 1, res["unpinned"]["gathers"]  # one per forward at least
        assert res["pinned"]["gathered_after"] == res["unpinned"]["gathered_after"] == 0
