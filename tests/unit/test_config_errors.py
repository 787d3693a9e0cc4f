"""Error messages: unknown, misspelled and wrongly typed keys at three nesting levels; API checks."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, parse_config


def error_of(config: dict, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(config, **kwargs)
    return str(info.value)


def base(**extra) -> dict:
    return {"train_batch_size": 8, **extra}


# --- unknown and misspelled keys ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,expected",
    [
        (base(gradient_clip=1.0), "gradient_clip: unknown key — did you mean gradient_clipping?"),
        (
            base(zero_optimization={"overlap_com": True}),
            "zero_optimization.overlap_com: unknown key — did you mean overlap_comm?",
        ),
        (
            base(zero_optimization={"offload_optimizer": {"devise": "cpu"}}),
            "zero_optimization.offload_optimizer.devise: unknown key — did you mean device?",
        ),
    ],
)
def test_misspelled_keys_get_a_suggestion(config, expected):
    assert error_of(config) == expected


@pytest.mark.parametrize(
    "config,expected",
    [
        (base(seed=42), "seed: unknown key (not a DeepSpeed config key at this level)"),
        (
            base(zero_optimization={"banana": 1}),
            "zero_optimization.banana: unknown key (not a DeepSpeed config key at this level)",
        ),
        (
            base(zero_optimization={"offload_optimizer": {"xyz": 1}}),
            "zero_optimization.offload_optimizer.xyz: unknown key; valid keys here: buffer_count, convert_grad_on_cpu, "
            "cpuadam_cores_perc, delayed_param_update, delayed_param_update_warm_up, device, fast_init, nvme_path, "
            "overlap_step, pin_memory, pipeline_read, pipeline_write, ratio, super_offload",
        ),
    ],
)
def test_unknown_keys_are_named(config, expected):
    assert error_of(config) == expected


# --- wrong types and ranges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,expected",
    [
        (base(steps_per_print="ten"), "steps_per_print: expected a positive integer or null, got 'ten'"),
        (base(gradient_clipping=-1), "gradient_clipping: expected a non-negative number, got -1"),
        (base(zero_optimization={"stage": 5}), "zero_optimization.stage: expected one of 0, 1, 2, 3, got 5"),
        (base(zero_optimization={"stage": "2"}), "zero_optimization.stage: expected one of 0, 1, 2, 3, got '2'"),
        (
            base(zero_optimization={"overlap_comm": "yes"}),
            "zero_optimization.overlap_comm: expected true or false or null, got 'yes'",
        ),
        (
            base(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
            "zero_optimization.offload_optimizer.device: expected one of 'none', 'cpu', 'nvme', got 'gpu'",
        ),
        (
            base(zero_optimization={"offload_optimizer": {"ratio": 1.5}}),
            "zero_optimization.offload_optimizer.ratio: expected a number between 0 and 1, got 1.5",
        ),
        (base(fp16={"loss_scale_window": "abc"}), "fp16.loss_scale_window: expected a positive integer, got 'abc'"),
        (base(fp16={"hysteresis": 0}), "fp16.hysteresis: expected a positive integer, got 0"),
        (base(fp16={"min_loss_scale": 0}), "fp16.min_loss_scale: expected a positive number, got 0"),
        (base(fp16=True), "fp16: expected an object ({...}), got true"),
        (
            base(zero_optimization={"offload_param": [1]}),
            "zero_optimization.offload_param: expected an object ({...}), got [1]",
        ),
        (base(optimizer={"params": [0.1]}), "optimizer.params: expected an object ({...}), got [0.1]"),
        (
            base(communication_data_type="int8"),
            "communication_data_type: expected one of 'fp32', 'fp16', 'bf16' (or null), got 'int8'",
        ),
        (
            base(gradient_clipping=float("nan")),
            "gradient_clipping: expected a non-negative number, got NaN (not finite)",
        ),
        (
            base(comms_logger={"prof_ops": ["all_reduce", 3]}),
            'comms_logger.prof_ops: expected a list of strings, got ["all_reduce", 3]',
        ),
    ],
)
def test_wrong_types_name_key_and_accepted_values(config, expected):
    assert error_of(config) == expected


def test_several_errors_each_on_its_own_line():
    message = error_of(
        base(
            gradient_clip=1.0,
            fp16={"hysteresis": "x"},
            zero_optimization={"stage": 9, "offload_optimizer": {"devise": "cpu"}},
        )
    )
    lines = message.splitlines()
    assert lines[0] == "4 problems in the config:"
    assert set(lines[1:]) == {
        "gradient_clip: unknown key — did you mean gradient_clipping?",
        "fp16.hysteresis: expected a positive integer, got 'x'",
        "zero_optimization.stage: expected one of 0, 1, 2, 3, got 9",
        "zero_optimization.offload_optimizer.devise: unknown key — did you mean device?",
    }


def test_errors_inside_lists_use_index_paths():
    config = base(tensor_parallel={"partition_config": {"layer_specs": [{"patterns": []}, {"partition": "row"}]}})
    assert error_of(config) == (
        "tensor_parallel.partition_config.layer_specs[1].partition: unknown key — did you mean partition_dim?"
    )


def test_non_string_key_in_a_dict_input():
    assert error_of({"train_batch_size": 8, 3: 1}) == "<top level>: keys must be strings, got 3"


def test_messages_never_show_pydantic_text():
    message = error_of(base(fp16=[], zero_optimization={"leaf_module": 5}, amp={"enabled": 1}))
    assert "pydantic" not in message and "validation error" not in message.lower()
    assert "Input should" not in message


# --- API checks -------------------------------------------------------------------------------


def test_max_grad_norm_in_optimizer_params_is_rejected():
    assert error_of(base(optimizer={"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}})) == (
        "optimizer.params.max_grad_norm is not supported; use the top-level gradient_clipping"
    )


def test_fp16_and_bf16_together_are_rejected():
    message = error_of(base(fp16={"enabled": True}, bf16={"enabled": True}))
    assert message == "fp16.enabled and bf16.enabled are both true; choose one precision mode"


def test_known_must_be_a_mapping():
    assert error_of(base(), known=[("a", 1)]) == "known must be a mapping of dotted keys to values, got list"


def test_non_config_input_types():
    assert error_of(None) == "config must be a dict, a path to a .json file, or base64-encoded JSON; got NoneType"
    assert error_of(3.5).endswith("got float")
