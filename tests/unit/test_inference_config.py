"""`init_inference`'s config: DeepSpeed 0.19's fields, defaults and aliases; conflicts and unknown keys are errors."""

from __future__ import annotations

import json

import pytest
import torch

from zerospeed.inference.api import merge_config
from zerospeed.inference.config import DeepSpeedInferenceConfig, validate_inference_config
from zerospeed.inference.injection import policy_partition_config, unmatched_policy_names
from zerospeed.parallel.tensor.plan import PRESETS
from zerospeed.utils.errors import ConfigError


def parse(config=None, **kwargs) -> DeepSpeedInferenceConfig:
    return validate_inference_config(merge_config(config, kwargs))


def test_deepspeed_defaults():
    c = parse()
    assert c.dtype is torch.float16 and c.replace_with_kernel_inject is False
    assert (c.tensor_parallel.enabled, c.tensor_parallel.tp_size, c.tensor_parallel.tp_grain_size) == (True, 1, 64)
    assert (c.max_out_tokens, c.min_out_tokens, c.keep_module_on_host, c.checkpoint) == (1024, 1, False, None)
    assert c.quant.enabled and c.quant.weight.num_bits == 8 and c.quant.weight.q_type == "symmetric"
    assert c.moe.enabled and c.moe.ep_size == 1 and c.moe.moe_experts == [1] and c.moe.type == "standard"
    assert c.zero.stage == 0 and c.triangular_masking and c.return_tuple and c.replace_method == "auto"
    assert c.unsupported() == []


@pytest.mark.parametrize("value", ["fp16", "torch.float16", "half", torch.half])
def test_dtype_spellings(value):
    assert parse(dtype=value).dtype is torch.float16


def test_aliases():
    c = parse(
        {
            "tp": {"tp_size": 2},
            "kernel_inject": True,
            "max_tokens": 64,
            "min_tokens": 2,
            "tm": False,
            "ckpt_config": {"checkpoint_dir": "/x"},
            "moe": {"num_experts": [4]},
        }
    )
    assert c.tensor_parallel.tp_size == 2 and c.replace_with_kernel_inject and c.max_out_tokens == 64
    assert c.min_out_tokens == 2 and not c.triangular_masking and c.checkpoint_config.checkpoint_dir == "/x"
    assert c.moe.moe_experts == [4]
    assert parse(moe=False).moe.enabled is False  # DeepSpeed's bare bool


def test_deprecated_keys_move_with_a_warning():
    with pytest.warns(DeprecationWarning) as caught:
        c = parse(mp_size=4, ep_size=2, moe_type="residual")
    assert "mp_size is deprecated, use tensor_parallel.tp_size" in str(caught[0].message) and len(caught) == 3
    assert c.tensor_parallel.tp_size == 4 and c.moe.ep_size == 2 and c.moe.type == "residual"
    with pytest.raises(ConfigError, match=r"mp_size \(deprecated\) and tensor_parallel.tp_size"):
        parse(mp_size=2, tensor_parallel={"tp_size": 2})


def test_config_and_kwarg_conflict_names_both(tmp_path):
    with pytest.raises(ConfigError, match=r"config\['dtype'\] = 'fp32' and the keyword argument dtype="):
        parse({"dtype": "fp32"}, dtype=torch.float16)
    with pytest.raises(ConfigError, match="tensor_parallel is given twice"):
        parse({"tp": {"tp_size": 2}}, tensor_parallel={"tp_size": 4})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"dtype": "fp16", "max_out_tokens": 8}))
    c = parse(str(path), dtype=torch.half, replace_with_kernel_inject=True)  # equal values are fine
    assert c.max_out_tokens == 8 and c.replace_with_kernel_inject
    with pytest.raises(ConfigError, match="kernel_inject and replace_with_kernel_inject are the same setting"):
        parse(kernel_inject=True, replace_with_kernel_inject=True)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"tensor_paralel": {}}, "tensor_paralel: unknown key — did you mean tensor_parallel?"),
        ({"tp": {"tp_siz": 2}}, "tensor_parallel.tp_siz: unknown key — did you mean tp_size?"),
        ({"max_out_tokens": 0}, "max_out_tokens: expected a positive integer, got 0"),
        ({"dtype": "fp8"}, "dtype: expected torch.float16"),
        ({"zero": {"stage": 3, "offload_parm": {}}}, "zero.offload_parm: unknown key — did you mean offload_param?"),
        ({"replace_with_kernel_inject": "yes"}, "replace_with_kernel_inject: expected true or false"),
    ],
)
def test_bad_values_name_the_key(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        parse(config)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"dtype": "int8"}, "dtype: int8 .* not implemented"),
        ({"enable_cuda_graph": True}, "enable_cuda_graph: true is not implemented"),
        ({"moe": {"ep_size": 2}}, "moe.ep_size: 2: expert parallelism at inference is not implemented"),
        ({"zero": {"stage": 2}}, "zero.stage: 2: ZeRO-Inference is stage 3"),
        ({"kernel_inject": True, "injection_dict": {"Block": "attn.o"}}, "give one"),
    ],
)
def test_parsed_but_not_implemented_is_named(config, message):
    import re

    problems = "; ".join(parse(config).unsupported())
    assert re.search(message, problems), problems


def test_zero_section_takes_the_training_spellings():
    c = parse(zero={"stage": 3, "offload_param": {"device": "cpu"}, "prefetch_bucket_size": 1000})
    assert c.zero.stage == 3 and c.zero.offload_param.device == "cpu" and c.zero.stage3_prefetch_bucket_size == 1000


def test_injection_policy_becomes_partition_rules():
    linears = ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "score"]
    cfg = policy_partition_config(linears, {"h.0": ("attn.c_proj", "mlp.c_proj")}, PRESETS["gpt2"])
    kinds = [(s["patterns"][0], s["partition_type"], s.get("shape")) for s in cfg["layer_specs"]]
    assert kinds == [
        (r"^h\.0\.attn\.c_attn\.weight$", "column", [3, -1]),  # fused shape kept from the preset
        (r"^h\.0\.attn\.c_proj\.weight$", "row", None),
        (r"^h\.0\.mlp\.c_fc\.weight$", "column", None),
        (r"^h\.0\.mlp\.c_proj\.weight$", "row", None),
        (r"^score\.weight$", "skip", None),
    ]
    assert cfg["use_default_specs"] is False
    assert unmatched_policy_names(["h.0", "h.0.attn", "h.0.attn.c_proj"], {"h.0": ("attn.c_proj", "mlp.out")}) == [
        "mlp.out"
    ]
    with pytest.raises(ConfigError, match="injection_policy"):
        parse(injection_policy=["attn.c_proj"])


def test_built_directly_like_deepspeed():
    with pytest.warns(DeprecationWarning):
        c = DeepSpeedInferenceConfig(mp_size=2, kernel_inject=True, dtype="bf16")
    assert c.tensor_parallel.tp_size == 2 and c.replace_with_kernel_inject and c.dtype is torch.bfloat16
