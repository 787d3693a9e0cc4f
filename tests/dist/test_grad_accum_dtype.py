"""`data_types.grad_accum_dtype: "bf16"` with bf16 training (fp32 masters) at ZeRO 0-3 on 2 ranks, 2 accumulation
steps, against one plain PyTorch process that rounds where the engine says it does.

The reference keeps a bf16 model and fp32 masters stepped by plain AdamW (copied to the model after each
step), and builds each step's gradient from the ranks' bf16 micro-batch gradients:
- ZeRO 0-1 (one reduction at the boundary): each rank sums its micro-batches in bf16, the two ranks'
  sums are added in bf16, then halved;
- ZeRO 2 (a reduction every micro-step, in the bf16 staging buffer): each micro-step's two gradients
  are added in bf16 and halved, and the results are summed into a bf16 gradient partition;
- ZeRO 3 (fp32 staging): each micro-step's pair is summed in fp32 and halved, then added into the bf16
  partition (one rounding per micro-step).
Losses and final weights must be equal, bit for bit. A run accumulating in fp32 (the default) does not
equal the reference; the test checks this, so the comparison can fail. Memory: the gradient buffers
(`memory_breakdown()["measured"]["gradients"]`, checked against the formula's 2 bytes x elements (/W
from stage 2)) are half of fp32 accumulation's.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import single_threaded
from zoo.models import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
MICRO, GAS, STEPS, WORLD = 2, 2, 4, 2
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
RUNS = [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (1, "fp32")]


def _batches():
    g = torch.Generator().manual_seed(13)
    return [
        torch.randint(0, CFG["vocab_size"], (WORLD * GAS * MICRO, CFG["block_size"]), generator=g) for _ in range(STEPS)
    ]


def _micro(batch, rank: int, m: int):
    start = (m * WORLD + rank) * MICRO  # harness.reference.split_global_batch's convention
    return batch[start : start + MICRO]


def _model():
    """The test GPT with its head untied: a tied weight's two uses add up in bf16 in an order that depends on
    the stage (autograd into a stage-0 `.grad` slot, or summed before a stage-1 hook, or reduced per use at
    stage 3), which this test's reference does not model."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model


def _train(stage: int, accum: str):
    import zerospeed
    from zerospeed import comm

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": accum},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank = comm.get_rank()
    losses = []
    for batch in _batches():
        step = []
        for m in range(GAS):
            ids = _micro(batch, rank, m)
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            step.append(loss.float().item())
        losses.append(step)
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "grad_bytes": engine.memory_breakdown()["measured"]["gradients"]}


def _runs():
    return {run: _train(*run) for run in RUNS}


def reference(stage: int):
    """(model, losses[step][m][rank]) with the gradient rounding of `stage` (see the module docstring)."""
    bf = torch.bfloat16
    model = _model()
    # the masters are the fp32 initial weights (the engine copies them before casting the model), the model bf16
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    model = model.to(bf)
    opt = torch.optim.AdamW(masters, **ADAMW)
    losses = []
    for batch in _batches():
        grads, step = {}, []  # (rank, m) -> bf16 gradients
        for m in range(GAS):
            row = []
            for r in range(WORLD):
                model.zero_grad(set_to_none=True)
                ids = _micro(batch, r, m)
                loss = model(ids, ids)
                (loss / GAS).backward()
                row.append(loss.float().item())
                grads[r, m] = [p.grad.clone() for p in model.parameters()]
            step.append(row)
        losses.append(step)
        for i, master in enumerate(masters):
            g = {k: v[i] for k, v in grads.items()}
            if stage <= 1:
                local = [g[r, 0] + g[r, 1] for r in range(WORLD)]  # bf16 accumulation on each rank
                total = (local[0] + local[1]) * 0.5  # one bf16 reduction
            elif stage == 2:
                total = (g[0, 0] + g[1, 0]) * 0.5 + (g[0, 1] + g[1, 1]) * 0.5  # bf16 each, bf16 partition
            else:
                first = ((g[0, 0].float() + g[1, 0].float()) * 0.5).to(bf)  # fp32 staging, into bf16
                total = (first.float() + (g[0, 1].float() + g[1, 1].float()) * 0.5).to(bf)
            master.grad = total.float()
        opt.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
    return model, losses


@pytest.mark.timeout(240)
def test_bf16_gradient_accumulation_rounds_where_the_engine_says_and_halves_gradient_memory():
    results = run_distributed(_runs, WORLD, timeout=200)
    with single_threaded():  # as the ranks compute (bf16 reductions round by thread split)
        refs = {stage: reference(stage) for stage in (0, 1, 2, 3)}
    n = sum(p.numel() for p in refs[0][0].parameters())
    for rank, res in enumerate(results):
        for stage in (0, 1, 2, 3):
            got, (model, losses) = res[stage, "bf16"], refs[stage]
            assert got["losses"] == [[row[rank] for row in step] for step in losses], (stage, rank)
            for key, value in model.state_dict().items():
                assert torch.equal(got["weights"][key], value), (stage, key, (got["weights"][key] - value).abs().max())
            per_element = 2 / (WORLD if stage >= 2 else 1)
            assert got["grad_bytes"] <= n * per_element * 1.02 + 64, (stage, got["grad_bytes"], n)
        fp32 = res[1, "fp32"]
        assert fp32["grad_bytes"] >= 2 * res[1, "bf16"]["grad_bytes"] * 0.98
        assert any(not torch.equal(fp32["weights"][k], v) for k, v in refs[1][0].state_dict().items())
