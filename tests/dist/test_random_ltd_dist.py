"""Random-LTD through `zerospeed.initialize` at ZeRO-2 on 2 ranks against one plain PyTorch process.

Each rank trains a tiny GPT whose blocks 1 and 2 are wrapped (`convert_to_random_ltd`) and records, per
forward, the reserved length and the token positions its layers kept (`random_ltd_scheduler.state
["sample_idx"]`, DeepSpeed's key). The reference is the unwrapped GPT run by hand in one process: blocks
1 and 2 get each sample's kept tokens by advanced indexing and write their outputs back the same way,
over the same global batches. The reserved lengths must follow the fixed_linear formula on every rank,
and the losses and final weights must match the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.data.random_ltd import convert_to_random_ltd, save_without_random_ltd
from zoo.data import text_batches
from zoo.models import GPT, Block, GPTConfig

WORLD, MICRO, GAS, STEPS, SEQ = 2, 2, 2, 6, 16
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=3, n_head=2, n_embd=16)
MIN, MAX, REQUIRE, PER_STEP = 8, SEQ, 4, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": 0.0,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000},
    "data_efficiency": {
        "enabled": True,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 3,
                "random_ltd_layer_num": 2,
                "random_ltd_layer_id": [1, 2],
                "model_mask_name": None,
                "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {
                    "min_value": MIN,
                    "max_value": MAX,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": REQUIRE, "seq_per_step": PER_STEP},
                },
            },
        },
    },
}


def reserved(step: int) -> int:
    """fixed_linear by hand: steps 0..5 give 8, 10 -> 8, 12, 14 -> 12, 16, 18 -> 16 (the cap)."""
    r = math.floor(MIN + (MAX - MIN) * step / REQUIRE)
    return min(r - r % PER_STEP, MAX)


def build_model():
    torch.manual_seed(0)
    return GPT(MODEL)


def train_rank():
    engine, *_ = zerospeed.initialize(model=build_model(), config=CONFIG)
    convert_to_random_ltd(engine, Block)
    rank = comm.get_rank()
    torch.manual_seed(100 + rank)  # the ranks draw different token subsets
    losses, lengths, kept = [], [], []
    for batch in text_batches(STEPS, WORLD * MICRO * GAS, SEQ):
        for x, y in split_global_batch(batch, WORLD, GAS, rank):
            loss = engine(x, y)
            r = engine.random_ltd_scheduler.get_current_seq()
            lengths.append(r)
            kept.append(engine.random_ltd_scheduler.state["sample_idx"].clone() if r < SEQ else None)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
    state = {k: v.detach().clone() for k, v in save_without_random_ltd(engine).items()}
    return {
        "losses": losses,
        "lengths": lengths,
        "kept": kept,
        "state": state,
        "consumed": engine.random_ltd_scheduler.state["consumed_layer_tokens"],
    }


def reference_loss(model, x, y, kept_BLR):
    """GPT's forward with blocks 1 and 2 run on each sample's kept tokens (kept_BLR[:, layer - 1])."""
    B, T = x.shape
    h = model.wte(x) + model.wpe(torch.arange(T))
    rows = torch.arange(B)[:, None]
    for i, block in enumerate(model.blocks):
        if i == 0:
            h = block(h)
            continue
        kept = kept_BLR[:, i - 1]
        out = h.clone()
        out[rows, kept] = block(h[rows, kept])
        h = out
    logits = model.lm_head(model.ln_f(h))
    return F.cross_entropy(logits.reshape(B * T, -1), y.reshape(B * T))


def global_kept(results, step):
    """The kept positions of step `step` for the global batch, [batch, layers, r], in the rows of
    `split_global_batch`; every token where the layers ran on the full sequence."""
    r = reserved(step)
    out = torch.empty(WORLD * GAS * MICRO, 2, r, dtype=torch.long)
    for rank, res in enumerate(results):
        for m in range(GAS):
            drawn = res["kept"][step * GAS + m]  # [layers, micro, r]
            start = (m * WORLD + rank) * MICRO
            out[start : start + MICRO] = (
                drawn.permute(1, 0, 2) if drawn is not None else torch.arange(SEQ).expand(MICRO, 2, SEQ)
            )
    return out


@pytest.mark.timeout(180)
def test_random_ltd_at_zero2_matches_plain_pytorch_on_the_same_token_subsets():
    results = run_distributed(train_rank, WORLD, timeout=150)
    want = [reserved(k) for k in range(STEPS) for _ in range(GAS)]
    assert want == [8, 8, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16]
    layer_tokens = sum(WORLD * MICRO * GAS * (reserved(k) * 2 + MAX * 1) for k in range(STEPS))
    for res in results:
        assert res["lengths"] == want and res["consumed"] == layer_tokens
        for r, drawn in zip(want, res["kept"]):
            assert drawn is None if r == SEQ else drawn.shape == (2, MICRO, r)
    assert not torch.equal(results[0]["kept"][0], results[1]["kept"][0])

    model = build_model()
    batches = [
        (x, y, global_kept(results, k)) for k, (x, y) in enumerate(text_batches(STEPS, WORLD * MICRO * GAS, SEQ))
    ]
    with torch.no_grad():  # the subsets matter: step 0's loss differs from the full model's
        x, y, kept = batches[0]
        assert abs(reference_loss(model, x, y, kept).item() - model(x, y).item()) > 1e-4
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ref_losses = reference_train(model, opt, batches, world_size=WORLD, grad_accum=GAS, loss_fn=reference_loss)
    got = [sum(res["losses"][k * GAS + m] for res in results for m in range(GAS)) / (WORLD * GAS) for k in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= 1e-5, (got, ref_losses)
    for res in results:
        assert list(res["state"]) == list(model.state_dict())
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
