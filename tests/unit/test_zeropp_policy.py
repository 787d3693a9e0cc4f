"""ZeRO++'s policy from the config: what is honoured, what is refused (no processes)."""
import pytest

from zerospeed.config import ConfigError, parse_config
from zerospeed.zero.stage3.zeropp import ZeroPPPolicy


def _zero(**keys):
    return parse_config({"train_batch_size": 1, "zero_optimization": keys}).zero_optimization


def test_stage3_switches_resolve():
    p = ZeroPPPolicy.from_config(_zero(stage=3, zero_quantized_weights=True, zero_hpz_partition_size=8,
                                       zero_quantized_gradients=True))
    assert p == ZeroPPPolicy(quantized_weights=True, hpz_size=8, quantized_gradients=True)
    assert ZeroPPPolicy.from_config(_zero(stage=3, zero_hpz_partition_size=0)).hpz_size == 1


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_refused_below_stage3_naming_the_key(stage):
    with pytest.raises(ConfigError, match=f"zero_quantized_gradients=true: .*stage is {stage}; set stage to 3"):
        ZeroPPPolicy.from_config(_zero(stage=stage, zero_quantized_gradients=True))


def test_hpz_refused_with_parameter_offload():
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2 with offload_param.device='cpu'"):
        ZeroPPPolicy.from_config(_zero(stage=3, zero_hpz_partition_size=2), offload_param="cpu")


def test_nontrainable_weights_at_stage3_only():
    assert ZeroPPPolicy.from_config(_zero(stage=3, zero_quantized_nontrainable_weights=True)) == \
        ZeroPPPolicy(quantized_nontrainable=True)
    assert ZeroPPPolicy.from_config(_zero(stage=3, zero_quantized_nontrainable_weights=True),
                                    offload_param="cpu").quantized_nontrainable
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights=true: .*stage is 2; set stage to 3"):
        ZeroPPPolicy.from_config(_zero(stage=2, zero_quantized_nontrainable_weights=True))
    assert ZeroPPPolicy.from_config(_zero(stage=3, zero_quantized_nontrainable_weights=True),
                                    offload_param="nvme").quantized_nontrainable
