"""The offload plan: where state goes, and the errors for configs that cannot work."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import ConfigError, parse_config
from zerospeed.offload.plan import HOST
from zerospeed.runtime.plans import offload_plan


def plan(zero, **extra):
    return offload_plan(parse_config({"train_batch_size": 1, "zero_optimization": zero, **extra}), torch.device("cpu"))


def test_no_offload_keeps_everything_on_the_device():
    p = plan({"stage": 2})
    assert (p.optimizer, p.param, p.master_device, p.shard_device) == (
        "none",
        "none",
        torch.device("cpu"),
        torch.device("cpu"),
    )


def test_cpu_offload_places_masters_and_shards_on_the_host():
    p = plan(
        {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "offload_param": {"device": "cpu"}}
    )
    assert p.master_device == HOST and p.shard_device == HOST and p.pin
    assert p.describe() == {
        "master_weights": "cpu",
        "optimizer_states": "cpu",
        "gradients": "cpu",
        "parameter_shards": "cpu",
    }


def test_nvme_plan_reads_the_swap_settings(tmp_path):
    p = plan(
        {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3, "buffer_size": 77},
        },
        aio={"block_size": 65536},
    )
    assert p.optimizer_nvme == tmp_path.resolve() and p.param_nvme == tmp_path.resolve()
    assert (p.pipeline_read, p.pipeline_write, p.param_buffer_count, p.param_buffer_size) == (True, False, 3, 77)
    assert p.aio.block_size == 65536


@pytest.mark.parametrize(
    "zero,needle",
    [
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            "offload_optimizer.device='cpu' needs ZeRO stage 1, 2 or 3",
        ),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device='cpu' needs ZeRO stage 3"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "offload_optimizer.ratio=0.5"),
        ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer.nvme_path"),
        (
            {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/no/such/dir"}},
            "zero_optimization.offload_param.nvme_path",
        ),
    ],
)
def test_impossible_offload_configs_name_the_key(zero, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        plan(zero)
