"""ZeRO stages 1 and 2 against a plain single-process PyTorch run (and stage 0 against them)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import per_world, reference_train, split_global_batch
from zerospeed import comm
from zerospeed.optim import build_lr_scheduler
from zoo.data import text_batches
from zoo.models import GPT, GPTConfig

MICRO, GAS, STEPS, SEQ = 2, 2, 8, 16
# n_embd 31 with one head: the trainable parameter count is odd, so no world size divides it.
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=1, n_embd=31, bias=False)
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}}


def build_model():
    torch.manual_seed(0)
    model = GPT(MODEL)
    model.wpe.weight.requires_grad_(False)  # a frozen layer: excluded from the partitions
    return model


def param_groups(model):
    """Two groups with their own lr and weight decay: matrices, and everything one-dimensional."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.05},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3},
    ]


def zero_config(stage, **over):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": SCHED,
        "gradient_clipping": 1.0,
        # small buckets and sub-groups: many reduce-scatters, several optimizer sub-steps
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 5000,
            "sub_group_size": 4000,
            "overlap_comm": True,
        },
    }
    if stage == 3:  # nothing persistent: every unit is gathered and freed around its use
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000)
    cfg.update(over)
    return cfg


def global_batches(world, steps=STEPS):
    n = world * MICRO * GAS
    return text_batches(steps, n, SEQ)


def train_ranks(config, steps=STEPS, inject_overflow_at=()):
    model = build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses, applied = [], []
    for step, batch in enumerate(global_batches(world, steps)):
        total = 0.0
        for x, y in split_global_batch(batch, world, GAS, rank):
            loss = engine(x, y)
            total += loss.item()
            if step in inject_overflow_at and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
        applied.append(engine.was_step_applied())
    if engine.zero_optimization_stage() == 3:
        state = {k: v.float() for k, v in engine.zero.full_state_dict().items()}  # rank 0 only
    else:
        state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {
        "losses": losses,
        "state": state,
        "applied": applied,
        "scale": engine.loss_scale,
        "skipped": engine.skipped_steps,
    }


def reference(world):
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3, weight_decay=0.0)
    sched = build_lr_scheduler(SCHED["type"], dict(SCHED["params"]), opt)
    losses = reference_train(
        model, opt, global_batches(world), world_size=world, grad_accum=GAS, scheduler=sched, clip=1.0
    )
    return losses, model.state_dict()


def test_model_has_an_odd_trainable_parameter_count():
    n = sum(p.numel() for p in build_model().parameters() if p.requires_grad)
    assert n % 2 == 1


STAGES = (1, 2, 3)
# fp16 starts at scale 2^10: from 2^16 the scaler's warm-up skips the first steps on overflow (by
# design), which delays the whole trajectory; the overflow path has its own test below.
PRECISIONS = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 10}}}
OVERFLOW = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}  # the fp16 block of the overflow run


def _every_run() -> dict:
    """Every run of this module at this world size, in one spawn (starting processes is the slow part on
    two cores): per stage the fp32 run; at 2 ranks also its bf16 and fp16 twins and the overflow run."""
    out, world = {}, comm.get_world_size()
    for stage in STAGES:
        out["fp32", stage] = train_ranks(zero_config(stage))
        if world == 2:
            for name, extra in PRECISIONS.items():
                out[name, stage] = {"losses": train_ranks(zero_config(stage, **extra))["losses"]}
            out["overflow", stage] = train_ranks(zero_config(stage, fp16=OVERFLOW), 4, inject_overflow_at=(1,))
    return out


@pytest.fixture(scope="module")
def runs():
    """world -> per rank {(kind, stage): result}, spawned when a test first needs that world size."""
    return per_world(_every_run, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,world", [(1, 2), (2, 2), (3, 2), (1, 4), (2, 4), (3, 4)])
def test_fp32_zero_matches_single_process_pytorch(stage, world, runs):
    results = [rank["fp32", stage] for rank in runs(world)]
    ref_losses, ref_state = reference(world)
    assert ref_losses[-1] < ref_losses[0] - 0.1
    for r in results:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
        assert len(diffs) == STEPS and max(diffs) <= 1e-5, diffs
    for r in results[:1]:  # stage 3 gathers the full weights on rank 0 only
        # Summation order differs from the reference (per-rank accumulation, then the reduction), and
        # Adam divides by sqrt(v): elements with near-zero gradients (some key-projection weights)
        # turn 1e-7 noise into ~2e-6 after 20 steps (the runs are 12 steps now) — stage 0 shows the same on this model.
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_and_fp16_stay_within_two_percent_of_fp32(stage, runs):
    rank0 = runs(2)[0]
    for name in PRECISIONS:
        rel = [abs(a - b) / b for a, b in zip(rank0[name, stage]["losses"], rank0["fp32", stage]["losses"])]
        assert max(rel) <= 0.02, (name, max(rel))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage, runs):
    r0, r1 = (rank["overflow", stage] for rank in runs(2))
    for r in (r0, r1):
        assert r["applied"] == [True, False, True, True] and r["skipped"] == 1
        assert r["scale"] == 128.0  # 2^8 halved once (hysteresis 1), window 1000 not reached
    if stage < 3:  # (stage 3 gathers full weights on rank 0 only)
        for k, v in r0["state"].items():
            assert torch.equal(v, r1["state"][k]), k
