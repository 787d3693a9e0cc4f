"""`bf16.bf16_master_weights_and_grads` / `bf16_optimizer_states` (Note [bf16 masters] in precision/policy.py):
DeepSpeed's rules as errors naming the keys, and the policy they resolve to. Training is
tests/dist/test_bf16_masters.py."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import parse_config
from zerospeed.precision.policy import PrecisionPolicy
from zerospeed.runtime.plans import precision_policy
from zerospeed.utils.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2}
BOTH = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _policy(bf16: dict, zero: dict | None = None) -> PrecisionPolicy:
    return precision_policy(parse_config({**BASE, "bf16": bf16, "zero_optimization": zero or {"stage": 2}}))


def test_both_switches_make_every_optimizer_dtype_bf16_and_drop_the_master_copy():
    p = _policy({"enabled": True, **BOTH})
    assert (p.param_dtype, p.master_dtype, p.grad_accum_dtype) == (torch.bfloat16,) * 3 and p.master_bytes == 0
    standard = _policy({"enabled": True})
    assert standard.master_dtype == torch.float32 and standard.master_bytes == 4


@pytest.mark.parametrize(
    "bf16, zero, match",
    [
        ({"enabled": False, **BOTH}, None, r"bf16.bf16_master_weights_and_grads=true needs bf16.enabled=true"),
        (
            {"enabled": True, "bf16_optimizer_states": True},
            None,
            r"bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads=true",
        ),
        ({"enabled": True, "bf16_master_weights_and_grads": True}, None, r"bf16_optimizer_states=false keeps fp32"),
        ({"enabled": True, **BOTH}, {"stage": 0}, r"needs ZeRO stage 1, 2 or 3"),
        (
            {"enabled": True, **BOTH},
            {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            r"offload_optimizer.device='cpu'",
        ),
    ],
)
def test_deepspeeds_rules_name_the_keys(bf16, zero, match):
    with pytest.raises(ConfigError, match=match):
        _policy(bf16, zero)
