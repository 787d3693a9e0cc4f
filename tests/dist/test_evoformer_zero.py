"""The Evoformer example (examples/zoo/evoformer.py: MSA row attention with pair bias, MSA column attention,
triangle attention around the starting and ending node, all on DS4Sci_EvoformerAttention) trained through
`zerospeed.initialize` at ZeRO-2 and ZeRO-3 (every parameter partitioned) on 2 ranks, against the same
model with the naive attention (materialised logits, torch.softmax) trained in one plain PyTorch process
(torch AdamW, the whole global batch per step): fp32 losses within 1e-5 over 10 steps, final weights too."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed
from harness.reference import engine_global_step
from zerospeed import comm
from zoo.evoformer import Evoformer, EvoformerConfig, evoformer_batch

MICRO, SEQS, RESIDUES, STEPS, LR = 2, 5, 12, 10, 3e-3


def model(attention: str) -> Evoformer:
    torch.manual_seed(0)
    return Evoformer(EvoformerConfig(attention=attention))


def batches(world: int):
    return [evoformer_batch(world * MICRO, SEQS, RESIDUES, seed=step) for step in range(STEPS)]


def train(stage: int) -> dict:
    m = model("evoformer")
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    world, rank = comm.get_world_size(), comm.get_rank()
    losses = [engine_global_step(engine, batch, world, 1, rank) for batch in batches(world)]
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights}


def both_stages():
    return [train(stage) for stage in (2, 3)]


@pytest.mark.timeout(90)
def test_evoformer_under_zero_2_and_3_matches_one_process_with_naive_attention():
    per_rank = run_distributed(both_stages, 2, timeout=80)
    ref = model("naive")
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    losses = reference_train(ref, opt, batches(2), world_size=2, grad_accum=1)
    assert losses[-1] < losses[0]
    for rank in per_rank:
        for stage, r in zip((2, 3), rank):
            assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= 1e-5, (stage, r["losses"], losses)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(r["weights"][name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
