"""The refusal tables: what is implemented parses; each requested missing feature errors, and so does each key
DeepSpeed 0.19.8 refuses itself (checked against its own parser's recorded messages)."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, check_implemented, parse_config
from zerospeed.config.features import DEEPSPEED_REFUSED, ROWS

SUFFIX = "is not implemented in zerospeed yet (tracked as a later issue); remove the key or set it to"


def test_implemented_features_parse_with_the_check_on():
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 100,
            "hysteresis": 3,
            "consecutive_hysteresis": True,
            "min_loss_scale": 0.25,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {}},
        "gradient_clipping": 1.0,
        "prescale_gradients": True,
        "gradient_predivide_factor": 2.0,
        "communication_data_type": "fp32",
        "gradient_allreduce_op": "sum",
        "steps_per_print": 5,
        "zero_optimization": {
            "stage": 0,
            "reduce_bucket_size": 1e6,
            "allgather_bucket_size": 1e6,
            "overlap_comm": True,
            "contiguous_gradients": False,
        },
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"tag_validation": "Fail"},
        "data_types": {"grad_accum_dtype": "fp32"},
        "dump_state": False,
        "wall_clock_breakdown": False,
        "aio": {"block_size": 4096},
        "compression_training": {},
        "pipeline": {"stages": "auto"},
    }
    cfg = parse_config(config, world_size=4)
    assert cfg.gradient_accumulation_steps == 2  # 16 / (2 * 4)


def test_bf16_implemented_too():
    assert parse_config({"train_batch_size": 1, "bf16": {"enabled": True, "immediate_grad_update": True}}).bf16_enabled


# One config per row that requests exactly that feature, written independently of the table.
TRIGGERS: dict[str, tuple[dict, str]] = {
    "zero_optimization.offload_optimizer.super_offload": (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}},
        "zero_optimization.offload_optimizer.super_offload=true: SuperOffload",
    ),
    "aio.use_gds": (
        {"aio": {"use_gds": True}, "zero_optimization": {"offload_param": {"device": "nvme"}}},
        "aio.use_gds=true: GPUDirect Storage",
    ),
    "fp16.fp16_master_weights_and_grads": (
        {"fp16": {"fp16_master_weights_and_grads": True}},
        "fp16.fp16_master_weights_and_grads=true",
    ),
    "optimizer.legacy_fusion": ({"optimizer": {"type": "Adam", "legacy_fusion": True}}, "optimizer.legacy_fusion"),
    "compile.deepcompile": ({"compile": {"deepcompile": True}}, "compile.deepcompile=true: DeepCompile"),
    "checkpoint.writer.type": (
        {"checkpoint": {"writer": {"type": "mock"}}},
        "checkpoint.writer.type='MOCK': the MOCK checkpoint writer",
    ),
}


def test_every_row_has_a_trigger():
    assert sorted(row.key for row in ROWS) == sorted(TRIGGERS)
    assert len(ROWS) <= 6  # issue 48's target: the table holds only what zerospeed still lacks


# One config per key DeepSpeed 0.19.8 refuses, with what DeepSpeed's own `DeepSpeedConfig(...)` raised for it
# (recorded from deepspeed 0.19.8 in /work/dsvenv: DeepSpeedConfigError; the random-LTD schedule parses there
# and its engine raises ValueError('not yet support') at initialize).
DEEPSPEED_SAYS: dict[str, tuple[dict, str]] = {
    "zero_optimization.zeropp_loco_param": (
        {"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}},
        "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' is no longer supported.",
    ),
    "zero_optimization.mics_hierarchical_params_gather": (
        {"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}},
        "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_hierarchical_params_gather' is no longer "
        "supported.",
    ),
    "amp.enabled": ({"amp": {"enabled": True}}, "NVIDIA Apex AMP integration has been removed."),
    "sparse_gradients": (
        {"sparse_gradients": True},
        "Sparse compression of dense torch.nn.Embedding gradients has been removed.",
    ),
    "graph_harvesting": ({"graph_harvesting": True}, "Graph harvesting has been removed;"),
    "eigenvalue.enabled": (
        {"eigenvalue": {"enabled": True}},
        "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed;",
    ),
    "quantize_training.enabled": (
        {"quantize_training": {"enabled": True}},
        "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed.",
    ),
    "nebula.enabled": ({"nebula": {"enabled": True}}, "Nebula checkpointing has been removed."),
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled": (
        {"data_efficiency": {"data_routing": {"random_ltd": {"layer_token_lr_schedule": {"enabled": True}}}}},
        "not yet support",
    ),
}
REFUSED_SUFFIX = "and zerospeed does not build it either; remove the key or set it to"


def test_every_deepspeed_refused_key_is_listed_with_deepspeeds_message():
    assert sorted(row.key for row in DEEPSPEED_REFUSED) == sorted(DEEPSPEED_SAYS)
    assert not {row.key for row in ROWS} & set(DEEPSPEED_SAYS)  # a key is a gap or DeepSpeed's refusal, not both


@pytest.mark.parametrize("key", sorted(DEEPSPEED_SAYS))
def test_each_key_deepspeed_refuses_is_refused_saying_so(key: str):
    config, deepspeed_says = DEEPSPEED_SAYS[key]
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, **config})
    lines = [line for line in str(info.value).splitlines() if line.startswith(key + "=")]
    assert len(lines) == 1, str(info.value)
    assert REFUSED_SUFFIX in lines[0] and SUFFIX not in lines[0]
    said_removed = "has been removed" in deepspeed_says
    assert ("removed from DeepSpeed in 0.19.8 (deepspeedai/DeepSpeed#8489" in lines[0]) == said_removed
    assert ("never built by DeepSpeed" in lines[0]) == (not said_removed)


@pytest.mark.parametrize("key", sorted(TRIGGERS))
def test_each_missing_feature_is_reported(key: str):
    config, start = TRIGGERS[key]
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, **config})
    lines = [line for line in str(info.value).splitlines() if line.startswith(key + "=")]
    assert len(lines) == 1, str(info.value)
    assert start in lines[0] and SUFFIX in lines[0]


def test_reference_marks_deepspeeds_refusals_apart_from_the_gaps():
    from zerospeed.config.reference import key_status

    assert key_status("nebula.enabled").startswith("refused (DeepSpeed too): Nebula checkpointing was removed")
    assert key_status("amp.opt_level").startswith("accepted, no effect (configures apex AMP, which DeepSpeed refuses")
    assert key_status("compile.deepcompile").startswith("not yet: DeepCompile")
    assert key_status("managed_gradient_accumulation") == "works"


def test_message_names_the_value_to_set():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "compile": {"deepcompile": True}})
    assert str(info.value) == (
        "compile.deepcompile=true: DeepCompile is not implemented in zerospeed yet "
        "(tracked as a later issue); remove the key or set it to false"
    )
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "amp": {"enabled": True}})
    assert str(info.value) == (
        "amp.enabled=true: apex AMP was removed from DeepSpeed in 0.19.8 (deepspeedai/DeepSpeed#8489; its config "
        "refuses the key too), and zerospeed does not build it either; remove the key or set it to false "
        "(use fp16, bf16 or torch_autocast instead)"
    )


def test_caller_managed_accumulation_is_no_longer_refused():
    assert (
        parse_config({"train_batch_size": 1, "managed_gradient_accumulation": False}).managed_gradient_accumulation
        is False
    )


def test_all_requested_features_are_listed_together():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "sparse_gradients": True, "amp": {"enabled": True}})
    lines = str(info.value).splitlines()
    assert [line.split("=")[0] for line in lines] == ["amp.enabled", "sparse_gradients"]


def test_aio_alone_is_fine():
    parse_config({"train_batch_size": 1, "aio": {"queue_depth": 16}})


def test_empty_compression_training_is_fine():
    parse_config({"train_batch_size": 1, "compression_training": {}})


def test_check_implemented_can_be_called_on_a_parsed_config():
    cfg = parse_config({"train_batch_size": 1, "sparse_gradients": True}, check_features=False)
    with pytest.raises(ConfigError, match="sparse compression of dense embedding gradients was removed from DeepSpeed"):
        check_implemented(cfg)
