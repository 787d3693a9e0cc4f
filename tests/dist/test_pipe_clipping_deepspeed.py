"""Gradient clipping in a pipeline: zerospeed clips by the whole model's norm (torch's `clip_grad_norm_`), DeepSpeed's
fp32 ZeRO-0 pipeline by the first stage's norm only (docs/pipeline.md, "Differences from DeepSpeed").

The fixture `pipe_clip` (make_pipe_tied.py, mode "clip", run by the real DeepSpeed 0.19.8): the fixture MLP of
make_pipe.py as a PipelineModule of 2 stages (layers 0-1 | 2-3), ZeRO 0, fp32, gradient_clipping 0.05, AdamW,
WarmupLR, 4 micro-batches of 2, 6 steps from the same initial weights; `deepspeed_run.pt` holds its losses. The
references are plain single-process PyTorch: one clips with `torch.nn.utils.clip_grad_norm_` over every parameter,
the other scales every gradient by min(1, 0.05 / (||stage-0 gradients|| + 1e-6)).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, fixture_script

CLIP, GAS, MICRO = 0.05, 4, 2


def layers():
    return fixture_script("make_pipe_tied").mlp_layers()  # the MLP DeepSpeed trained (seeded)


def batches():
    return fixture_script("make_pipe_tied").batches(1, width=3)


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (log, 4 steps to 1e-2, min 0) for optimizer step `step` (0-based): its first two
    steps run at 0 (it starts at iteration -1, and log(1) = 0)."""
    it = step - 1
    return 0.0 if it < 0 else 1e-2 * (math.log(it + 1) / math.log(4) if it < 4 else 1.0)


def reference(norm_over: str) -> list[float]:
    """`norm_over`: "model" (torch's clip_grad_norm_) or "stage0" (the first stage's parameters only)."""
    model = torch.nn.Sequential(*layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    first = [*model[0].parameters(), *model[1].parameters()]
    losses = []
    for step, (x, y) in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step)
        total = 0.0
        for i in range(GAS):
            loss = torch.nn.functional.mse_loss(model(x[i * MICRO : (i + 1) * MICRO]), y[i * MICRO : (i + 1) * MICRO])
            (loss / GAS).backward()
            total += loss.item()
        losses.append(total / GAS)
        if norm_over == "model":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        else:
            coef = min(1.0, CLIP / (torch.stack([p.grad.norm() for p in first]).norm().item() + 1e-6))
            for p in model.parameters():
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
    return losses


def deepspeed_losses() -> list[float]:
    return torch.load(FIXTURES / "pipe_clip" / "deepspeed_run.pt", weights_only=True)["losses"]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_deepspeeds_fp32_pipeline_clips_by_the_first_stages_norm():
    ds = deepspeed_losses()
    assert gap(ds, reference("stage0")) <= 1e-6
    assert gap(ds, reference("model")) > 1e-3  # torch's clipping gives another run


def _zerospeed_run() -> list[float]:
    import zerospeed
    from zerospeed.pipe import PipelineModule

    net = PipelineModule(layers=layers(), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "gradient_clipping": CLIP,
    }
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    out = []
    for x, y in batches():
        micro = iter([(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(GAS)])
        out.append(float(engine.train_batch(data_iter=micro)))
    return out


@pytest.mark.timeout(120)
def test_zerospeeds_pipeline_clips_by_the_whole_models_norm_as_torch():
    ref = reference("model")
    for losses in run_distributed(_zerospeed_run, 2, timeout=100):
        assert gap(losses, ref) <= 1e-6, (losses, ref)
        assert gap(losses, deepspeed_losses()) > 1e-3
