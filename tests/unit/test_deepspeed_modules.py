"""DeepSpeed's modules and names served by zerospeed (issue 49), against what DeepSpeed 0.19.8 itself returns.

The reference values in tests/fixtures/deepspeed_0.19.8/deepspeed_names.json were recorded from the real
DeepSpeed by `make_names.py` beside it (its docstring has the command): pipeline schedules step by step,
expert-parallel rank groups, the LR-schedule key names, the trimmed mean, the launcher's resource filter,
the pipeline partition helpers (`partition_*`, `prefix_sum_inc`, `call_to_str`), the leaf-module defaults
and the NVMe swap threshold.
"""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest
import torch

import zerospeed
from zerospeed import version
from zerospeed.comm.handles import MultipleAllGatherHandles
from zerospeed.compat.distribution import DEEPSPEED_API_VERSION
from zerospeed.config.deepspeed import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DeepSpeedConfig,
    DeepSpeedConfigModel,
    DeepSpeedZeroConfig,
    get_bfloat16_config,
)
from zerospeed.launcher.deepspeed_runner import _parse_hostfile, parse_args, parse_resource_filter
from zerospeed.parallel import groups
from zerospeed.parallel.pipeline import clocked
from zerospeed.parallel.pipeline import schedules as zs
from zerospeed.parallel.pipeline.clocked import call_to_str
from zerospeed.parallel.pipeline.grid import _prime_factors
from zerospeed.parallel.pipeline.partition import partition, partition_balanced, partition_uniform, prefix_sum_inc
from zerospeed.profiling.timers import trim_mean
from zerospeed.utils import safe_update_full_grad_vectorized
from zerospeed.utils.errors import ConfigError, DeepSpeedConfigError

DS = json.loads(
    (pathlib.Path(__file__).parents[1] / "fixtures" / "deepspeed_0.19.8" / "deepspeed_names.json").read_text()
)


def _steps(sched) -> list[str]:
    return [" ".join(f"{type(c).__name__}:{getattr(c, 'buffer_id', '')}" for c in cmds) for cmds in sched]


@pytest.mark.parametrize("key", sorted(DS["schedules"]))
def test_pipe_schedules_step_for_step(key):
    """`deepspeed.runtime.pipe.schedule` is zerospeed's schedules on DeepSpeed's clock: every step, every
    instruction and buffer as DeepSpeed's own generators give them."""
    kind, stages, micro_batches, stage_id = key.split("/")
    sched = getattr(clocked, kind)(micro_batches=int(micro_batches), stages=int(stages), stage_id=int(stage_id))
    assert sched.num_pipe_buffers() == DS["schedules"][key]["buffers"]
    assert _steps(sched) == DS["schedules"][key]["steps"]


def test_clock_refuses_a_reordering():
    """The clock only spaces zerospeed's order out: a stream whose order the clock would change is an error."""
    with pytest.raises(AssertionError, match="clock step"):
        clocked.clock_of([zs.ForwardPass(1), zs.ForwardPass(0)], stage=0, stages=2, train=True)


@pytest.mark.parametrize("key", sorted(DS["expert_ranks"]))
def test_expert_parallel_ranks(key):
    world, tp, ep, pp = map(int, key.split("/"))
    assert [list(g) for g in groups._get_expert_parallel_ranks(world, tp, ep, pp)] == DS["expert_ranks"][key]


def test_groups_without_a_mesh_are_the_plain_world():
    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    assert groups._get_model_parallel_world_size() == 1 and groups._get_data_parallel_group() is None


def test_lr_schedule_key_constants():
    lrs = importlib.import_module("zerospeed.runtime.lr_schedules")
    ours = {name: getattr(lrs, name) for name in DS["lr_constants"]}
    assert ours == DS["lr_constants"]


@pytest.mark.parametrize("data,pct,expected", DS["trim_mean"])
def test_trim_mean(data, pct, expected):
    given = list(data)
    assert trim_mean(given, pct) == pytest.approx(expected)
    assert given == data  # not sorted in place


@pytest.mark.parametrize("include,exclude,expected", DS["resource_filter"])
def test_parse_resource_filter(include, exclude, expected):
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert parse_resource_filter(hosts, include_str=include, exclude_str=exclude) == expected


@pytest.mark.parametrize("flags", ["--num_nodes 1 -i localhost", "--num_gpus 1 -e localhost"])
def test_runner_main_raises_on_contradicting_flags(flags):
    """DeepSpeed's `runner.main(args=...)` raises a ValueError for `--num_nodes`/`--num_gpus` with `-i`/`-e`
    (its tests/unit/launcher/test_run.py); the `zerospeed` command turns the same error into exit code 2."""
    from zerospeed.launcher import cli, deepspeed_runner

    runner = importlib.import_module("zerospeed.launcher.runner")
    assert runner.main is deepspeed_runner.main
    with pytest.raises(ValueError, match="cannot be combined with --include/--exclude"):
        runner.main(args=[*flags.split(), "foo.py"])
    assert cli.main([*flags.split(), "foo.py"]) == 2


def test_runner_helpers():
    assert dict(_parse_hostfile(["worker-0 slots=4", "# c", "worker-1 slots=2"])) == {"worker-0": 4, "worker-1": 2}
    args = parse_args(["--num_gpus", "2", "train.py", "--lr", "1"])
    assert (args.user_script, args.user_args, args.num_gpus) == ("train.py", ["--lr", "1"], 2)
    with pytest.raises(ValueError):
        parse_resource_filter({"a": [0]}, include_str="a", exclude_str="a")


@pytest.mark.parametrize("n,parts,expected", DS["partition_uniform"])
def test_partition_uniform(n, parts, expected):
    assert partition_uniform(n, parts) == expected


@pytest.mark.parametrize("weights,parts,expected", DS["partition_balanced"])
def test_partition_balanced(weights, parts, expected):
    """DeepSpeed's criterion (least spread between the heaviest and lightest part) and its tie-breaking;
    fewer items than parts leaves parts empty."""
    assert partition_balanced(weights, parts) == expected


def test_pipeline_partition_refuses_empty_stages():
    """The helpers give empty parts (DeepSpeed's bounds); a pipeline stage needs a layer."""
    assert partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]
    for method in ("uniform", "parameters"):
        with pytest.raises(ConfigError, match="cannot split 3 layers into 4 pipeline parts"):
            partition(method, class_names=["A"] * 3, param_counts=[1, 2, 1], num_parts=4)


@pytest.mark.parametrize("weights,expected", DS["prefix_sum_inc"])
def test_prefix_sum_inc(weights, expected):
    assert prefix_sum_inc(weights) == expected


@pytest.mark.parametrize("args,kwargs,expected", DS["call_to_str"])
def test_call_to_str(args, kwargs, expected):
    assert call_to_str(*args, **kwargs) == expected
    assert repr(clocked.RecvGrad(buffer_id=1)) == "RecvGrad(buffer_id=1)"


def test_min_swappable_bytes():
    swap_tensor = importlib.import_module("zerospeed.runtime.swap_tensor")
    assert swap_tensor.MIN_SWAPPABLE_BYTES == DS["min_swappable_bytes"]


def test_leaf_module_defaults():
    assert DEFAULT_LEAF_MODULE_CLASSES == DS["leaf_module_classes"]


def test_version_info():
    assert version.version == DS["version"]
    assert list(version.parse_version(f"{DS['version']}+zerospeed.0.1.0")) == DS["version_fields"]
    assert version.DEEPSPEED_API_VERSION == DEEPSPEED_API_VERSION  # the shim's version and this one agree
    assert version.required_torch_version(min_version="2.0") and not version.required_torch_version(max_version=1.0)


def test_deepspeed_config_over_the_typed_config():
    cfg = DeepSpeedConfig({"train_batch_size": 64, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 64, 1)
    assert cfg.bfloat16_enabled and cfg.zero_optimization_stage == 2 and cfg.zero_config.overlap_comm is False
    assert cfg._param_dict["bf16"] == {"enabled": True}
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError):  # DeepSpeed checks the batch sizes with assert
        cfg._configure_train_batch_size()
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_deepspeed_zero_config_reads_old_spellings():
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled


def test_config_model_deprecated_fields():
    from pydantic import Field

    class Conf(DeepSpeedConfigModel):
        new: list[str] | None = None
        old: str | None = Field(
            None, json_schema_extra={"deprecated": True, "new_param": "new", "new_param_fn": lambda v: [v]}
        )

    assert Conf(old="x").new == ["x"]
    with pytest.raises(AssertionError):
        Conf(old="x", new=["y"])
    with pytest.raises(ValueError):  # strict: a typo is an error (pydantic's ValidationError)
        Conf(nwe=["y"])


def test_op_builders_need_no_build():
    ops = importlib.import_module("zerospeed.ops")
    builders = importlib.import_module("zerospeed.ops.op_builder")
    assert ops.__compatible_ops__[builders.CPUAdamBuilder.NAME]
    assert builders.CPUAdamBuilder().load().DeepSpeedCPUAdam is zerospeed.ops.adam.DeepSpeedCPUAdam


def test_multiple_all_gather_handles_pass_keywords_only_where_taken():
    seen = []

    class Ours:
        def wait(self):
            seen.append("ours")

    class Theirs:
        def wait(self, *, handle_dependency=True):
            seen.append(handle_dependency)

    MultipleAllGatherHandles([Ours(), Theirs()]).wait(handle_dependency=False)
    assert seen == ["ours", False]


def test_on_device_builds_on_meta_in_the_dtype():
    with zerospeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(3, 4)
    assert layer.weight.is_meta and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with zerospeed.OnDevice(dtype=torch.float16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_prime_factors():
    for n in range(1, 60):
        factors = _prime_factors(n)
        assert factors == sorted(factors) and all(all(f % d for d in range(2, f)) for f in factors)
        product = 1
        for f in factors:
            product *= f
        assert product == n
    with pytest.raises(ValueError):
        _prime_factors(0)


def test_safe_update_full_grad_vectorized_on_plain_parameters():
    """DeepSpeed's semantics on a parameter that holds its gradient: grad <- update_func(grad, param)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    safe_update_full_grad_vectorized([p, frozen], lambda grad, param: grad * 3 + param)
    assert torch.equal(p.grad, torch.full((3,), 7.0)) and frozen.grad is None
