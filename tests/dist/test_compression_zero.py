"""The compression library under ZeRO: QAT (8 -> 6 bits), activation quantization, sparse, row and (learned,
topk) head pruning on the test GPT, trained at
ZeRO stages 0, 2 and 3 (every parameter partitioned: persistence threshold 0) on 2 ranks, against the same
compressed model trained in one plain PyTorch process
(torch AdamW, the whole global batch per step): losses within 1e-5, and the compressed forward of the
final weights within 1e-5."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed
from harness.reference import engine_global_step
from zerospeed import comm
from zerospeed.compression.compress import init_compression
from zerospeed.compression.scheduler import scheduler_for
from zoo.data import text_batches
from zoo.models import GPT, GPTConfig

MICRO, SEQ, STEPS, LR = 2, 8, 6, 3e-3
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, bias=False)
COMPRESSION = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 1},
            "different_groups": {
                "wq": {"params": {"start_bits": 8, "target_bits": 6, "quantization_period": 2}, "modules": ["attn"]}
            },
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 2},
            "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": [r"mlp\.proj"]}},
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
            "different_groups": {
                "rp": {"params": {"dense_ratio": 0.5}, "modules": [r"mlp\.fc"], "related_modules": [[r"mlp\.proj"]]}
            },
        },
        "head_pruning": {
            "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 1, "num_heads": 2},
            "different_groups": {"hp": {"params": {"dense_ratio": 0.5}, "modules": [r"attn\.proj"]}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 3},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.fc"]}},
        },
    }
}


def compressed_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(MODEL)
    init_compression(model, COMPRESSION)
    return model


def batches(world: int):
    n = world * MICRO
    return text_batches(STEPS, n, SEQ)


def train(stage: int) -> dict:
    model = compressed_gpt()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **COMPRESSION,
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    world, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for batch in batches(world):
        losses.append(engine_global_step(engine, batch, world, 1, rank))
    probe = batches(world)[0][0][:2]
    with torch.no_grad():
        logits = engine.module(probe)
    return {"losses": losses, "logits": logits}


def all_stages():
    return [train(stage) for stage in (0, 2, 3)]  # (stage 1 shards like 2, reducing at the boundary only)


@pytest.mark.timeout(150)
def test_compressed_training_under_zero_matches_single_process():
    per_rank = run_distributed(all_stages, 2, timeout=130)
    model = compressed_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    schedule = scheduler_for(model)  # the engine advances the compression schedule after each step
    losses = []
    for batch in batches(2):
        losses += reference_train(model, opt, [batch], world_size=2, grad_accum=1)
        schedule.step()
    with torch.no_grad():
        logits = model(batches(2)[0][0][:2])
    for rank in per_rank:
        for stage, r in enumerate(rank):
            assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= 1e-5, (stage, r["losses"], losses)
            torch.testing.assert_close(r["logits"], logits, atol=1e-5, rtol=0)
    assert losses[-1] < losses[0]
    torch.manual_seed(0)
    plain = GPT(MODEL)  # compression really changes the run: the uncompressed model's losses differ
    plain_losses = reference_train(
        plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0), batches(2), world_size=2, grad_accum=1
    )
    assert max(abs(a - b) for a, b in zip(plain_losses, losses)) > 1e-2
