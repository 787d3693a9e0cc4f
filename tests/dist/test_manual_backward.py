"""DeepSpeed's manual backward: `engine.scale(loss).backward()` then `engine.step()`, against one plain
PyTorch process (harness.reference) over the same global batches: 2 ranks, 2 accumulation
steps, ZeRO 0 (whose `param.grad` DeepSpeed users read after backward), 2 and 3; the ranks' mean loss per
step and the final weights within 1e-6. No biases: a key bias has no gradient in exact arithmetic (softmax
is shift-invariant), so Adam would turn its rounding noise into lr-sized steps that differ between any
two summation orders."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import reference_train, split_global_batch
from zoo.models import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
MICRO, GAS, STEPS, WORLD, TOL = 2, 2, 3, 2, 1e-6
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _batches():
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, CFG["vocab_size"], (WORLD * GAS * MICRO, CFG["block_size"]), generator=g),)
        for _ in range(STEPS)
    ]


def _train(stage: int):
    import zerospeed
    from zerospeed import comm

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    losses, grads_seen = [], True
    for batch in _batches():
        total = 0.0
        for (ids,) in split_global_batch(batch, WORLD, GAS, comm.get_rank()):
            loss = engine(ids, ids)
            engine.scale(loss).backward()
            if stage == 0:  # DeepSpeed's stage 0 leaves the averaged gradients in param.grad
                grads_seen &= all(p.grad is not None for p in model.parameters())
            engine.step()
            total += loss.item()
        losses.append(total / GAS)
    try:
        engine.scale(torch.ones(2, requires_grad=True) * 2)
        refused = None
    except ValueError as e:
        refused = str(e)
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "weights": weights,
        "grads_seen": grads_seen,
        "refused": refused,
        "steps": engine.global_steps,
    }


def _runs(stages):
    return {stage: _train(stage) for stage in stages}


def reference():
    """One plain process over the same global batches: (the trained model, its loss per step)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    ref = reference_train(
        model,
        torch.optim.AdamW(model.parameters(), **ADAMW),
        _batches(),
        world_size=WORLD,
        grad_accum=GAS,
        loss_fn=lambda m, ids: m(ids, ids),
    )
    return model, ref


@pytest.mark.timeout(240)
def test_scale_then_manual_backward_trains_like_plain_pytorch():
    stages = (0, 2, 3)
    results = run_distributed(_runs, WORLD, stages, timeout=200)
    model, ref = reference()
    for stage in stages:
        got = [r[stage] for r in results]
        mean = [sum(g["losses"][i] for g in got) / WORLD for i in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(mean, ref)) <= TOL, (stage, mean, ref)
        for g in got:
            assert g["steps"] == STEPS and g["grads_seen"] and "one-element" in g["refused"], stage
            for key, value in model.state_dict().items():
                torch.testing.assert_close(g["weights"][key], value, atol=TOL, rtol=0, msg=f"stage {stage} {key}")
