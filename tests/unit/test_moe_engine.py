"""An MoE model through a one-process engine: param groups are split for the user (as DeepSpeed does),
a client optimizer with experts in dense groups is refused, and the monitors get each layer's aux loss
and per-expert token counts."""

import csv

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.moe.layer import MoE

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(6, nn.Linear(6, 6), num_experts=3, k=2, min_capacity=0, top2_2nd_expert_sampling=False)

    def forward(self, x):
        out, l_aux, _ = self.moe(x)
        return out.pow(2).mean() + 0.1 * l_aux


def test_groups_split_and_monitor_events(tmp_path):
    cfg = dict(CFG, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "moe"})
    engine, *_ = zerospeed.initialize(model=Net(), config=cfg)
    groups = engine.optimizer.param_groups
    assert [g.get("moe", False) for g in groups] == [False, True] and groups[1]["name"] == "ep_size_1"
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    with open(tmp_path / "moe" / "Train_MoE_layer_0_l_aux.csv") as f:
        rows = list(csv.reader(f))[1:]
    assert len(rows) == 2 and float(rows[-1][1]) == pytest.approx(float(engine.module.moe.deepspeed_moe.l_aux.detach()))
    counts = []
    for e in range(3):
        with open(tmp_path / "moe" / f"Train_MoE_layer_0_expert_{e}_tokens.csv") as f:
            counts.append(float(list(csv.reader(f))[-1][1]))
    assert sum(counts) == 2 * 8  # k = 2 choices for each of the 8 tokens
    engine.observer.close()


def test_client_optimizer_with_experts_in_dense_groups_is_refused():
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(ConfigError, match="split_params_into_different_moe_groups_for_optimizer"):
        zerospeed.initialize(model=net, optimizer=opt, config={"train_micro_batch_size_per_gpu": 2})
