"""ZeRO 1-3 with a branch that some steps do not use, persistent and sharded units mixed, against
plain PyTorch (zero gradients for the unused branch, as DeepSpeed does)."""

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed
from harness.reference import engine_global_step
from zerospeed import comm

MICRO, GAS, STEPS = 2, 2, 10


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 24)
        self.odd = torch.nn.Linear(24, 24)  # used on even steps only
        self.out = torch.nn.Linear(24, 5)
        self.frozen = torch.nn.Linear(24, 24)
        self.frozen.requires_grad_(False)

    def forward(self, x, y, use_odd):
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        if use_odd:
            h = torch.tanh(self.odd(h))
        return torch.nn.functional.mse_loss(self.out(h), y)


def batches(world):
    g = torch.Generator().manual_seed(3)
    n = world * MICRO * GAS
    return [(torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)) for _ in range(STEPS)]


def _train(stage):
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        # 300-element threshold: biases stay resident, weight matrices are gathered and freed
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 300, "reduce_bucket_size": 500},
    }
    engine, *_ = zerospeed.initialize(model=Branchy(), config=cfg)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for step, batch in enumerate(batches(world)):
        losses.append(engine_global_step(engine, batch, world, GAS, rank, step % 2 == 0))
    state = engine.zero.full_state_dict() if stage == 3 else engine.module.state_dict()
    return losses, {k: v.float().clone() for k, v in state.items()}


class _Ref(Branchy):
    step = 0

    def forward(self, x, y):
        return super().forward(x, y, self.step % 2 == 0)


def _every_stage(stages):
    return {stage: _train(stage) for stage in stages}  # one spawn: starting processes is the slow part


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_every_stage, 2, (1, 2, 3), timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_branch_and_frozen_layer_match_pytorch(stage, runs):
    results = [rank[stage] for rank in runs]
    torch.manual_seed(0)
    ref = _Ref()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for step, batch in enumerate(batches(2)):
        ref.step = step
        ref_losses += reference_train(ref, opt, [batch], world_size=2, grad_accum=GAS, clip=0.5, set_to_none=False)
    losses, state = results[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
