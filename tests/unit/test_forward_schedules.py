"""The legacy curriculum scheduler and progressive layer drop: their formulas by hand, and what the engine
passes to a training forward, step by step, against a plain PyTorch loop that truncates its batches by
the same formula (the step hooks, runtime/hooks.py, Note [forward schedules])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerospeed
from zerospeed.data.progressive_layer_drop import ProgressiveLayerDrop
from zerospeed.runtime.data_pipeline import CurriculumScheduler
from zerospeed.utils.errors import ConfigError


def scheduler(kind, **schedule):
    return CurriculumScheduler(
        {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": kind, "schedule_config": schedule}
    )


def test_fixed_linear_and_fixed_root_by_hand():
    lin = scheduler("fixed_linear", total_curriculum_step=10, difficulty_step=8)
    # floor(8 + 56 t / 10), down to a multiple of 8, at most 64: t=1 13.6->8, t=3 24.8->24, t=5 36->32
    assert [lin.get_difficulty(t) for t in (0, 1, 3, 5, 10, 20)] == [8, 8, 24, 32, 64, 64]
    root = scheduler("fixed_root", total_curriculum_step=10, difficulty_step=8, root_degree=2)
    # t=1: 8 + 56 sqrt(0.1) = 25.7 -> 24; t=4: 8 + 56 sqrt(0.4) = 43.4 -> 40; t=9: 61.1 -> 56
    assert [root.get_difficulty(t) for t in (1, 4, 9, 10)] == [24, 40, 56, 64]


def test_fixed_discrete_and_custom_and_the_cap():
    disc = scheduler("fixed_discrete", difficulty=[8, 16, 32], max_step=[5, 10])
    assert [disc.get_difficulty(t) for t in (0, 5, 6, 10, 11, 100)] == [8, 8, 16, 16, 32, 32]
    custom = scheduler("custom")
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        custom.update_difficulty(1)
    custom.set_custom_get_difficulty(lambda t: 8 * t)
    assert [custom.update_difficulty(t) for t in (1, 3, 8, 2)] == [8, 24, 64, 64]  # at the maximum it stays
    assert custom.get_current_difficulty() == 64 and custom.get_state()["current_difficulty"] == 64


@pytest.mark.parametrize(
    "config, key",
    [
        ({"max_difficulty": 64, "schedule_type": "fixed_linear"}, "curriculum_learning.min_difficulty"),
        ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "steps"}, "curriculum_learning.schedule_type"),
        (
            {
                "min_difficulty": 8,
                "max_difficulty": 64,
                "schedule_type": "fixed_root",
                "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
            },
            "curriculum_learning.schedule_config.root_degree",
        ),
        (
            {
                "min_difficulty": 8,
                "max_difficulty": 64,
                "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [8, 16], "max_step": [5, 10]},
            },
            "fixed_discrete needs one more difficulty",
        ),
    ],
)
def test_config_errors_name_the_key(config, key):
    with pytest.raises(ConfigError, match=key):
        CurriculumScheduler(config)


def test_progressive_layer_drop_theta_by_hand():
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.01)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    pld.update_state(100)
    assert pld.get_theta() == pytest.approx(0.5 * math.exp(-1.0) + 0.5, rel=1e-15)


# -- through the engine --------------------------------------------------------------------------------
V, T, MICRO, GAS, STEPS = 32, 16, 2, 2, 6
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 4,
    "max_difficulty": 16,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4},
}


class TruncatingLM(nn.Module):
    """Megatron-DeepSpeed's use of the curriculum: train on the first `curriculum_seqlen` tokens."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, 16), nn.Linear(16, V)
        self.seen = []

    def forward(self, x, y, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        self.seen.append((curriculum_seqlen, progressive_layer_drop, pld_theta))
        if curriculum_seqlen is not None:
            x, y = x[:, :curriculum_seqlen], y[:, :curriculum_seqlen]
        return F.cross_entropy(self.head(self.emb(x)).reshape(-1, V), y.reshape(-1))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (MICRO, T + 1), generator=g) for _ in range(STEPS * GAS)]


def _seqlen(step: int) -> int:  # the fixed_linear formula of CURRICULUM, for global step `step`
    d = math.floor(4 + 12 * step / 4)
    return min(d - d % 4, 16)


def test_engine_passes_the_schedules_to_training_forwards_like_a_plain_loop():
    torch.manual_seed(0)
    model = TruncatingLM()
    reference = TruncatingLM()
    reference.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "curriculum_learning": CURRICULUM,
        "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1},
    }
    engine, *_ = zerospeed.initialize(model=model, config=config)
    assert engine.curriculum_enabled_legacy() and engine.curriculum_params_legacy()["max_difficulty"] == 16
    losses = []
    for batch in _batches():
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # forward of global step k (k = 0, 1, ...): the curriculum at k + 1, theta(k - 1) (1.0 for k = 0)
    want = [
        (_seqlen(k + 1), True, 1.0 if k == 0 else 0.5 * math.exp(-0.1 * (k - 1)) + 0.5)
        for k in range(STEPS)
        for _ in range(GAS)
    ]
    assert [s[:2] for s in model.seen] == [w[:2] for w in want]
    assert [s[2] for s in model.seen] == pytest.approx([w[2] for w in want], rel=1e-12)
    assert engine.get_pld_theta() == pytest.approx(0.5 * math.exp(-0.1 * (STEPS - 1)) + 0.5, rel=1e-12)
    engine.eval()
    engine(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    assert model.seen[-1] == (None, False, None)  # evaluation forwards get nothing

    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses, batches = [], _batches()
    for k in range(STEPS):
        opt.zero_grad()
        for batch in batches[k * GAS : (k + 1) * GAS]:
            loss = reference(batch[:, :-1], batch[:, 1:], curriculum_seqlen=_seqlen(k + 1))
            (loss / GAS).backward()
            ref_losses.append(loss.item())
        opt.step()
    assert losses == pytest.approx(ref_losses, abs=1e-6)


def test_the_pipeline_engine_refuses_layer_drop_by_name():
    from zerospeed.parallel.pipeline import PipelineModule

    module = PipelineModule([nn.Linear(2, 2)], num_stages=1, loss_fn=nn.MSELoss())
    with pytest.raises(ConfigError, match="progressive_layer_drop.enabled=true with a PipelineModule"):
        zerospeed.initialize(
            model=module, config={"train_micro_batch_size_per_gpu": 1, "progressive_layer_drop": {"enabled": True}}
        )
