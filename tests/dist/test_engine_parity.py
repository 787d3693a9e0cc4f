"""Stage 0 (data parallel) against a plain single-process PyTorch run on the same global batches."""

from __future__ import annotations

import copy

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.optim import build_lr_scheduler
from zoo.data import text_batches
from zoo.models import GPT, GPTConfig

WORLD, MICRO, GAS, STEPS, SEQ = 2, 4, 2, 20, 16
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=32, bias=False)
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}}


def parity_config(**over):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": SCHED,
        "gradient_clipping": 1.0,
        # a small bucket size: several buckets, launched while backward still runs
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},
    }
    cfg.update(over)
    return cfg


def global_batches(steps=STEPS):
    # real text (the stdlib's own source): a loss that can fall, unlike uniform random tokens
    return text_batches(steps, WORLD * MICRO * GAS, SEQ)


def train_ranks(config, steps=STEPS, inject_overflow_at=()):
    """Runs on every rank: train through the engine, return per-step mean loss over all ranks."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses, scales, applied = [], [], []
    for step, batch in enumerate(global_batches(steps)):
        total = 0.0
        for x, y in split_global_batch(batch, world, engine.gradient_accumulation_steps(), rank):
            loss = engine(x, y)
            total += loss.item()
            if step in inject_overflow_at and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        t = torch.tensor([total / engine.gradient_accumulation_steps()])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
        scales.append(engine.loss_scale)
        applied.append(engine.was_step_applied())
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {
        "losses": losses,
        "state": state,
        "scales": scales,
        "applied": applied,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "samples": engine.global_samples,
    }


@pytest.mark.timeout(300)
def test_fp32_stage0_matches_single_process_pytorch():
    results = run_distributed(train_ranks, WORLD, parity_config(), timeout=240)

    torch.manual_seed(0)
    ref_model = GPT(MODEL)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = build_lr_scheduler(SCHED["type"], copy.deepcopy(SCHED["params"]), opt)
    ref_losses = reference_train(
        ref_model, opt, global_batches(), world_size=WORLD, grad_accum=GAS, scheduler=sched, clip=1.0
    )

    for r in results:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
        assert len(diffs) == STEPS and max(diffs) <= 1e-5, diffs
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        assert r["global_steps"] == STEPS and r["samples"] == STEPS * WORLD * MICRO * GAS
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it really trained


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision):
    cfg = parity_config(**{precision: {"enabled": True}})
    results = run_distributed(train_ranks, WORLD, cfg, 12, timeout=240)
    losses = results[0]["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
    # ranks stay in lock-step: identical weights everywhere
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k


@pytest.mark.timeout(300)
def test_fp16_overflow_on_one_rank_skips_everywhere():
    cfg = parity_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 2})
    results = run_distributed(train_ranks, WORLD, cfg, 6, timeout=240, inject_overflow_at=(2, 3))
    for r in results:
        assert r["applied"] == [True, True, False, False, True, True]
        assert r["skipped"] == 2 and r["global_steps"] == 6
        # hysteresis 2: the first overflow is absorbed, the second halves the scale
        assert r["scales"] == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k
