"""Resuming a DeepSpeed pipeline run in zerospeed's PipelineEngine (Note [DeepSpeed pipeline checkpoints] in
checkpoint/deepspeed_pipeline.py).

The fixture `pipe_zero0` (make_pipe.py) is the tag the real DeepSpeed 0.19.8's PipelineEngine saved after 3 of 6
`train_batch` steps of the fixture MLP's layers as a PipelineModule of 2 stages on 2 ranks (fp32, ZeRO 0,
AdamW, WarmupLR, 4 micro-batches of 2); `deepspeed_run.pt` holds the 6 losses `train_batch` returned and the
weights after step 6 (DeepSpeed's own step-6 layer files). zerospeed's PipelineEngine loads the tag at 2
stages and at 1 and trains steps 4-6: DeepSpeed's losses and final weights within 1e-6. Without the
optimizer states the losses differ (the test can fail).

Both runs set `gradient_clipping: 0.0`. At the default (1.0) zerospeed's PipelineEngine clips by the norm over
all stages, and differs from DeepSpeed's pipeline run by 3.1e-3 at step 6 even from scratch; DeepSpeed's fp32
ZeRO-0 pipeline clips by the first stage's norm only, which stayed under 1.0 here (docs/pipeline.md, "Differences
from DeepSpeed"; tests/dist/test_pipe_clipping_deepspeed.py).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_pipeline_continuation

FIXTURE = FIXTURES / "pipe_zero0"
RUN_FILE = FIXTURE / "deepspeed_run.pt"


def batches():
    g = torch.Generator().manual_seed(1)  # the fixtures' make.py
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]


def _resume(stages: int, with_optimizer: bool = True) -> dict:
    import zerospeed
    from zerospeed.pipe import PipelineModule

    torch.manual_seed(1)  # other initial weights than DeepSpeed's: the load must bring them
    layers = [torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)]
    net = PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # as DeepSpeed's run (see the module docstring)
    }
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(
        str(FIXTURE), tag="step3", load_optimizer_states=with_optimizer, load_lr_scheduler_states=with_optimizer
    )
    steps, losses = engine.global_steps, []
    for x, y in batches()[3:]:
        micro = iter([(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)])
        losses.append(float(engine.train_batch(data_iter=micro)))
    weights = {}
    for idx in net.local_layer_indices():
        module = net.layer_module(idx)
        if module is not None:
            weights.update({f"{idx}.{k}": v.detach().clone() for k, v in module.state_dict().items()})
    return {"losses": losses, "steps": steps, "weights": weights}


def _expected() -> dict:
    return torch.load(RUN_FILE, weights_only=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 1])
def test_a_deepspeed_pipeline_run_resumes_in_zerospeeds_pipeline_engine(world):
    assert_pipeline_continuation(run_distributed(_resume, world, world, timeout=100), RUN_FILE)


def _weights_only():
    return _resume(2, with_optimizer=False)


@pytest.mark.timeout(120)
def test_without_the_optimizer_states_the_pipeline_continuation_differs():
    got, want = run_distributed(_weights_only, 2, timeout=100)[0], _expected()
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1e-4
