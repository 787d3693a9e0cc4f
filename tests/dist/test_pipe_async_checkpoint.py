"""Asynchronous pipeline saves (Note [asynchronous pipeline saves] in parallel/pipeline/checkpoint.py).

With `checkpoint.writer.decoupled`, a PipelineEngine's `save_checkpoint` returns after a host snapshot and `latest`
moves only when the save commits (at the end of the next `train_batch`, or at `wait_for_checkpoint()`). A fresh
engine that loads the committed tag continues exactly as the run that saved it (2 stages, a tied layer, ZeRO 0 and
ZeRO 1 on pp 2 x dp 1).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

MICRO, GAS = 2, 4


def head(module, x):
    return torch.nn.functional.linear(x, module.weight.t())


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]


def _engine(seed: int, zero: int, asynchronous: bool):
    import zerospeed
    from zerospeed.pipe import PipelineModule, TiedLayerSpec

    torch.manual_seed(seed)
    layers = [
        TiedLayerSpec("t", torch.nn.Linear, 4, 4, bias=False),
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 4),
        TiedLayerSpec("t", torch.nn.Linear, 4, 4, bias=False, forward_fn=head),
    ]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": zero},
        "gradient_clipping": 1.0,
    }
    if asynchronous:
        cfg["checkpoint"] = {"writer": {"decoupled": True}}
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine


def _train(engine, steps) -> list[float]:
    return [
        float(engine.train_batch(data_iter=iter([(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, 8, MICRO)])))
        for x, y in steps
    ]


def _run(folder: str, zero: int) -> dict:
    from pathlib import Path

    latest = Path(folder) / "latest"
    engine = _engine(0, zero, True)
    _train(engine, batches()[:3])
    engine.save_checkpoint(folder, tag="step3")
    before_commit = latest.exists()
    continued = _train(engine, batches()[3:])  # the first train_batch commits the save
    after_commit = latest.read_text() if latest.exists() else None
    engine.save_checkpoint(folder, tag="step6")
    engine.wait_for_checkpoint()
    at_wait = latest.read_text()
    fresh = _engine(1, zero, True)
    fresh.load_checkpoint(folder, tag="step3")
    resumed = _train(fresh, batches()[3:])
    return {"before": before_commit, "after": after_commit, "wait": at_wait, "cont": continued, "resumed": resumed}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [0, 1])
def test_an_asynchronous_pipeline_save_commits_later_and_resumes_exactly(tmp_path, zero):
    for r in run_distributed(_run, 2, str(tmp_path), zero, timeout=150):
        assert r["before"] is False  # save_checkpoint returned before `latest` moved
        assert r["after"] == "step3" and r["wait"] == "step6"
        assert max(abs(a - b) for a, b in zip(r["cont"], r["resumed"])) <= 1e-6, (r["cont"], r["resumed"])
