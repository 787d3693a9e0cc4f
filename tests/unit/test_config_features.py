"""The not-implemented-yet table: what is implemented parses; each requested missing feature errors."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, check_implemented, parse_config
from zerospeed.config.features import ROWS

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
    "zero_optimization.zeropp_loco_param": (
        {"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}},
        ": LoCo-ZeRO++ (DeepSpeed 0.19.8 removed it as well",
    ),
    "zero_optimization.mics_hierarchical_params_gather": (
        {"zero_optimization": {"mics_hierarchical_params_gather": True}},
        "MiCS hierarchical gather",
    ),
    "aio.use_gds": (
        {"aio": {"use_gds": True}, "zero_optimization": {"offload_param": {"device": "nvme"}}},
        "aio.use_gds=true: GPUDirect Storage",
    ),
    "amp.enabled": ({"amp": {"enabled": True}}, "amp.enabled=true: apex AMP"),
    "fp16.fp16_master_weights_and_grads": (
        {"fp16": {"fp16_master_weights_and_grads": True}},
        "fp16.fp16_master_weights_and_grads=true",
    ),
    "optimizer.legacy_fusion": ({"optimizer": {"type": "Adam", "legacy_fusion": True}}, "optimizer.legacy_fusion"),
    "sparse_gradients": ({"sparse_gradients": True}, "sparse_gradients=true"),
    "graph_harvesting": ({"graph_harvesting": True}, "graph_harvesting=true"),
    "managed_gradient_accumulation": ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation=false"),
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled": (
        {"data_efficiency": {"data_routing": {"random_ltd": {"layer_token_lr_schedule": {"enabled": True}}}}},
        "random_ltd.layer_token_lr_schedule.enabled=true: random-LTD's layer-token learning-rate schedule",
    ),
    "eigenvalue.enabled": ({"eigenvalue": {"enabled": True}}, "eigenvalue.enabled=true"),
    "quantize_training.enabled": ({"quantize_training": {"enabled": True}}, "quantize_training.enabled=true"),
    "compile.deepcompile": ({"compile": {"deepcompile": True}}, "compile.deepcompile=true: DeepCompile"),
    "nebula.enabled": ({"nebula": {"enabled": True}}, "nebula.enabled=true"),
    "checkpoint.writer.type": (
        {"checkpoint": {"writer": {"type": "mock"}}},
        "checkpoint.writer.type='MOCK': the MOCK checkpoint writer",
    ),
}


def test_every_row_has_a_trigger():
    assert sorted(row.key for row in ROWS) == sorted(TRIGGERS)


@pytest.mark.parametrize("key", sorted(TRIGGERS))
def test_each_missing_feature_is_reported(key: str):
    config, start = TRIGGERS[key]
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, **config})
    lines = [line for line in str(info.value).splitlines() if line.startswith(key + "=")]
    assert len(lines) == 1, str(info.value)
    assert start in lines[0] and SUFFIX in lines[0]


def test_message_names_the_value_to_set():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "nebula": {"enabled": True}})
    assert str(info.value) == (
        "nebula.enabled=true: Nebula checkpointing (DeepSpeed 0.19.8 removed it as well: "
        "deepspeedai/DeepSpeed#8489) is not implemented in zerospeed yet "
        "(tracked as a later issue); remove the key or set it to false"
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
    with pytest.raises(
        ConfigError, match="sparse compression of dense embedding gradients .DeepSpeed 0.19.8 removed it as well"
    ):
        check_implemented(cfg)
