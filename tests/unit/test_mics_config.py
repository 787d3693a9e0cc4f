"""MiCS's refusals (`zero_optimization.mics_shard_size`, Note [MiCS] in zero/strategy.py), one process: each
names the key and the fix. The 4-rank training is tests/dist/test_mics.py."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed.utils.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize(
    "zero, match",
    [
        ({"stage": 2, "mics_shard_size": 1}, r"mics_shard_size=1 cannot be combined with zero_optimization.stage=2"),
        ({"stage": 3, "mics_shard_size": 1, "zero_hpz_partition_size": 2}, r"zero_hpz_partition_size > 1"),
        ({"stage": 3, "mics_shard_size": 1, "zero_quantized_gradients": True}, r"zero_quantized_gradients"),
        ({"stage": 3, "mics_shard_size": 2}, r"mics_shard_size=2 must divide the data-parallel size 1"),
    ],
)
def test_mics_refusals_name_the_key(zero, match):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=match):
        zerospeed.initialize(model=model, config={**BASE, "zero_optimization": zero})


def test_a_shard_group_of_the_whole_data_parallel_group_is_plain_stage_3():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = zerospeed.initialize(
        model=model, config={**BASE, "zero_optimization": {"stage": 3, "mics_shard_size": 1}}
    )
    assert engine.mics_shard_size() == 1 and all(u.replicas == 1 for u in engine.zero.units)
