"""Resuming DeepSpeed pipeline runs with a tied layer, saved at ZeRO 1 and at ZeRO 0, in zerospeed's PipelineEngine
(Note [DeepSpeed pipeline checkpoints] in checkpoint/deepspeed_pipeline.py).

The fixtures (make_pipe_tied.py, run by the real DeepSpeed 0.19.8): a tied `Linear(4, 4)` first and again last
through a `forward_fn` (DeepSpeed writes no layer file for that one), `Linear(4, 8)`, `LayerNorm`, `ReLU`,
`Linear(8, 4)` as 2 stages; `pipe_tied_zero1` on pp 2 x dp 2 with ZeRO 1 and gradient_clipping 1.0,
`pipe_tied_zero0` on pp 2 with ZeRO 0. Each tag was saved after 3 of 6 `train_batch` steps; `deepspeed_run.pt`
holds DeepSpeed's 6 losses and its weights after step 6. zerospeed loads the tag at other stage counts, data-
parallel sizes and ZeRO stages, trains steps 4-6 on the same samples, and gives DeepSpeed's losses and final
weights within 1e-6. Without the optimizer states the losses differ (the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_pipeline_continuation, continue_tied_pipeline, fixture_script

MICRO = 2
MAKE = fixture_script("make_pipe_tied")  # the model and batches DeepSpeed trained


def _resume(fixture: str, ds_dp: int, pp: int, zero: int, gas: int, clip: float, with_optimizer: bool = True):
    import zerospeed
    from zerospeed import comm
    from zerospeed.pipe import PipelineModule, TiedLayerSpec

    torch.manual_seed(1)  # other initial weights than DeepSpeed's: the load must bring them
    net = PipelineModule(
        layers=MAKE.layers(TiedLayerSpec), num_stages=pp, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": zero},
        "gradient_clipping": clip,
    }
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(
        str(FIXTURES / fixture), tag="step3", load_optimizer_states=with_optimizer, load_lr_scheduler_states=True
    )
    dp = comm.get_world_size(engine.dp_group)
    assert dp * gas * MICRO == 8 * ds_dp  # the same global batch as DeepSpeed's run
    steps = engine.global_steps
    losses, weights = continue_tied_pipeline(engine, net, MAKE.batches(ds_dp), gas, MICRO)
    return {"losses": losses, "steps": steps, "weights": weights}


def _check(results: list[dict], fixture: str) -> None:
    assert_pipeline_continuation(results, FIXTURES / fixture / "deepspeed_run.pt")


# (world, pp, zero stage, gradient accumulation): the saved layout, other stage counts / dp sizes / stages
ZERO1_CASES = [(4, 2, 1, 4), (2, 2, 0, 8), (2, 1, 1, 4), (2, 2, 2, 8)]
ZERO0_CASES = [(2, 2, 0, 4), (2, 1, 1, 2), (1, 1, 0, 4)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,pp,zero,gas", ZERO1_CASES)
def test_a_deepspeed_zero1_pipeline_run_with_a_tied_layer_resumes_in_zerospeed(world, pp, zero, gas):
    _check(run_distributed(_resume, world, "pipe_tied_zero1", 2, pp, zero, gas, 1.0, timeout=200), "pipe_tied_zero1")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,pp,zero,gas", ZERO0_CASES)
def test_a_deepspeed_zero0_pipeline_run_with_a_tied_layer_resumes_in_zerospeed(world, pp, zero, gas):
    _check(run_distributed(_resume, world, "pipe_tied_zero0", 1, pp, zero, gas, 0.0, timeout=150), "pipe_tied_zero0")


@pytest.mark.timeout(180)
def test_without_the_optimizer_states_the_tied_pipeline_continuation_differs():
    got = run_distributed(_resume, 2, "pipe_tied_zero1", 2, 2, 0, 8, 1.0, False, timeout=150)[0]
    want = torch.load(FIXTURES / "pipe_tied_zero1" / "deepspeed_run.pt", weights_only=True)
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"][3:])) > 1e-4
