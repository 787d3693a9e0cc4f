"""ZeRO++'s policy from the config (the engine's plans, runtime/plans.py): what is honoured, what is refused
(no processes)."""

import pytest

from zerospeed.config import ConfigError, parse_config
from zerospeed.runtime.plans import zeropp_policy
from zerospeed.zero.stage3.zeropp import ZeroPPPolicy


def _zero(**keys):
    return parse_config({"train_batch_size": 1, "zero_optimization": keys}).zero_optimization


def test_stage3_switches_resolve():
    p = zeropp_policy(
        _zero(stage=3, zero_quantized_weights=True, zero_hpz_partition_size=8, zero_quantized_gradients=True)
    )
    assert p == ZeroPPPolicy(quantized_weights=True, hpz_size=8, quantized_gradients=True)
    assert zeropp_policy(_zero(stage=3, zero_hpz_partition_size=0)).hpz_size == 1


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_refused_below_stage3_naming_the_key(stage):
    with pytest.raises(ConfigError, match=f"zero_quantized_gradients=true: .*stage is {stage}; set stage to 3"):
        zeropp_policy(_zero(stage=stage, zero_quantized_gradients=True))


def test_hpz_refused_with_parameter_offload():
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2 with offload_param.device='cpu'"):
        zeropp_policy(_zero(stage=3, zero_hpz_partition_size=2), offload_param="cpu")


def test_nontrainable_weights_at_stage3_only():
    assert zeropp_policy(_zero(stage=3, zero_quantized_nontrainable_weights=True)) == ZeroPPPolicy(
        quantized_nontrainable=True
    )
    assert zeropp_policy(
        _zero(stage=3, zero_quantized_nontrainable_weights=True), offload_param="cpu"
    ).quantized_nontrainable
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights=true: .*stage is 2; set stage to 3"):
        zeropp_policy(_zero(stage=2, zero_quantized_nontrainable_weights=True))
    assert zeropp_policy(
        _zero(stage=3, zero_quantized_nontrainable_weights=True), offload_param="nvme"
    ).quantized_nontrainable
