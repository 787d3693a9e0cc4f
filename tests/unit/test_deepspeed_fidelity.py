"""Fidelity to DeepSpeed 0.19.8 (issue #22): every expected value below is DeepSpeed's.

The constants come from running DeepSpeed itself (a separate virtualenv, never imported here) with the
script at the bottom of this file, commented out: `DS_ACCELERATOR=cpu python ds_reference.py`, one
process on gloo. Each test says which printed line its constants are. Where zerospeed differs on
purpose (docs/migrating_from_deepspeed.md, "Where zerospeed differs on purpose") the test says so
and checks our value next to DeepSpeed's.

One-process engines only; no worker processes.
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch

import zerospeed
from zerospeed.checkpoint import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zerospeed.checkpoint.export import plan_shards
from zerospeed.config import ConfigError, parse_config
from zerospeed.data.loader import RepeatingLoader, build_training_loader
from zerospeed.optim import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerospeed.pipe import PipelineModule


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ 1. zero_to_fp32

# "SIG ..." lines: inspect.signature of deepspeed.utils.zero_to_fp32's functions.
DS_SIGNATURES = {
    "convert_zero_checkpoint_to_fp32_state_dict": [
        ("checkpoint_dir", None),
        ("output_dir", None),
        ("max_shard_size", "5GB"),
        ("safe_serialization", False),
        ("tag", None),
        ("exclude_frozen_parameters", False),
    ],
    "get_fp32_state_dict_from_zero_checkpoint": [
        ("checkpoint_dir", None),
        ("tag", None),
        ("exclude_frozen_parameters", False),
        ("lazy_mode", False),
    ],
    "load_state_dict_from_zero_checkpoint": [("model", None), ("checkpoint_dir", None), ("tag", None)],
}
OURS = {
    f.__name__: f
    for f in (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )
}


@pytest.mark.parametrize("name", sorted(DS_SIGNATURES))
def test_zero_to_fp32_signatures_are_deepspeeds(name):
    params = list(inspect.signature(OURS[name]).parameters.values())
    ds = DS_SIGNATURES[name]
    positional = [
        (p.name, None if p.default is inspect.Parameter.empty else p.default)
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == ds
    # our extras come after DeepSpeed's, keyword-only
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(ds) :])


# "CONVERT ..." lines: the files DeepSpeed's convert_zero_checkpoint_to_fp32_state_dict writes for a
# stage-2 checkpoint of Sequential(Linear(4, 8), Linear(8, 2)) (232 bytes of fp32).
DS_FILES = {
    (): ["pytorch_model.bin"],
    (("safe_serialization", True),): ["model.safetensors"],
    (("max_shard_size", 100),): [
        "pytorch_model-00001-of-00003.bin",
        "pytorch_model-00002-of-00003.bin",
        "pytorch_model-00003-of-00003.bin",
        "pytorch_model.bin.index.json",
    ],
    (("max_shard_size", 100), ("safe_serialization", True)): [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ],
}
DS_WEIGHT_MAP_SHARD = {"0.weight": 1, "0.bias": 2, "1.weight": 2, "1.bias": 3}  # shard number per tensor
DS_TOTAL_SIZE = 232


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = zerospeed.initialize(
        model=model,
        config={
            "train_batch_size": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
        },
    )
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    root = tmp_path_factory.mktemp("ckpt")
    engine.save_checkpoint(str(root))
    return root


@pytest.mark.parametrize("options", sorted(DS_FILES), ids=lambda o: "-".join(f"{k}={v}" for k, v in o) or "default")
def test_convert_writes_deepspeeds_files(tiny_checkpoint, tmp_path, options):
    kw = dict(options)
    out = tmp_path / "out"
    written = convert_zero_checkpoint_to_fp32_state_dict(tiny_checkpoint, out, **kw)
    assert sorted(p.name for p in out.iterdir()) == DS_FILES[options]
    assert sorted(p.name for p in written) == DS_FILES[options]  # DeepSpeed returns None; we return the paths
    index = [p for p in written if p.name.endswith(".index.json")]
    if index:
        body = json.loads(index[0].read_text())
        assert body["metadata"]["total_size"] == DS_TOTAL_SIZE
        assert {k: int(v.split("-")[1]) for k, v in body["weight_map"].items()} == DS_WEIGHT_MAP_SHARD


def test_convert_takes_deepspeeds_positional_order(tiny_checkpoint, tmp_path):
    # (checkpoint_dir, output_dir, max_shard_size, safe_serialization, tag, exclude_frozen_parameters)
    written = convert_zero_checkpoint_to_fp32_state_dict(tiny_checkpoint, tmp_path, 100, True, "global_step1", False)
    assert [p.name for p in written][-1] == "model.safetensors.index.json"


def test_shards_are_grouped_as_deepspeeds_converter_groups_them():
    # huggingface_hub.split_torch_state_dict_into_shards (which DeepSpeed's converter calls) on uint8
    # tensors of 4, 4, 3, 12, 1 bytes: an oversized tensor takes a shard at once, the open one stays open.
    sizes = [("a", 4), ("b", 4), ("c", 3), ("d", 12), ("e", 1)]
    assert plan_shards(sizes, 10) == [["a", "b"], ["d"], ["c", "e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert plan_shards(sizes, None) == [["a", "b", "c", "d", "e"]]  # DeepSpeed's max_shard_size=None


def test_lazy_mode_tensors_materialise_with_contiguous(tiny_checkpoint):
    sd = get_fp32_state_dict_from_zero_checkpoint(tiny_checkpoint, lazy_mode=True)
    full = get_fp32_state_dict_from_zero_checkpoint(tiny_checkpoint)
    assert all(torch.equal(sd[k].contiguous(), full[k]) for k in full)


def test_load_state_dict_from_zero_checkpoint_is_not_strict_by_default(tiny_checkpoint, caplog):
    # DeepSpeed: model.load_state_dict(state_dict, strict=False), silently. Ours warns (on purpose).
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="zerospeed.checkpoint.consolidate"):
        assert load_state_dict_from_zero_checkpoint(model, tiny_checkpoint) is model
    assert "missing ['2.weight', '2.bias']" in caplog.text
    assert torch.equal(model[0].weight, get_fp32_state_dict_from_zero_checkpoint(tiny_checkpoint)["0.weight"])
    with pytest.raises(RuntimeError, match="Missing key"):
        load_state_dict_from_zero_checkpoint(model, tiny_checkpoint, strict=True)


# ------------------------------------------------------------------ 3. save_checkpoint / load_checkpoint dirs

# "SAVE ..." / "LOAD ..." lines.
DS_SAVE_ERRORS = {
    "": "save_dir must be a non-empty string, got ''",
    None: "save_dir must be a non-empty string, got None",
}


@pytest.fixture(scope="module")
def engines():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    plain, *_ = zerospeed.initialize(
        model=model, config={"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    )
    pipe_module = PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, loss_fn=torch.nn.MSELoss())
    pipe, *_ = zerospeed.initialize(
        model=pipe_module, config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    )
    return {"plain": plain, "pipe": pipe}


@pytest.mark.parametrize("kind", ["plain", "pipe"])
@pytest.mark.parametrize("save_dir", ["", None])
def test_save_checkpoint_needs_a_directory(engines, tmp_path, monkeypatch, kind, save_dir):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        engines[kind].save_checkpoint(save_dir)
    assert str(err.value).startswith(DS_SAVE_ERRORS[save_dir])
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory


@pytest.mark.parametrize("kind", ["plain", "pipe"])
def test_load_checkpoint_dirs(engines, tmp_path, monkeypatch, kind):
    # DeepSpeed: load_checkpoint(None) -> TypeError (from os.path.join); load_checkpoint("") looks for
    # ./latest and, with none, warns and returns (None, None).
    with pytest.raises(TypeError, match="load_dir must be a str or path, got None"):
        engines[kind].load_checkpoint(None)
    monkeypatch.chdir(tmp_path)
    assert engines[kind].load_checkpoint("") == (None, None)


# ------------------------------------------------------------------ 4. gradient_allreduce_op with ZeRO-3

# "ALLREDUCE ..." lines: DeepSpeedConfig(...) raises ValueError at stage 3 and parses "sum" at stage 2.
DS_ALLREDUCE_ERROR = "gradient_allreduce_op='sum' is not supported with ZeRO stage 3"


def test_gradient_allreduce_sum_is_refused_with_zero_3():
    with pytest.raises(ConfigError) as err:  # a ValueError, as DeepSpeed's
        parse_config({"train_batch_size": 2, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
    assert str(err.value).startswith(DS_ALLREDUCE_ERROR)
    assert 'set gradient_allreduce_op to "mean"' in str(err.value)
    assert (
        parse_config(
            {"train_batch_size": 2, "gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 2}}
        ).gradient_allreduce_op
        == "sum"
    )


# ------------------------------------------------------------------ 2 and 6. LR schedulers


def two_groups(opt_cls, **kw):
    return opt_cls(
        [{"params": [torch.nn.Parameter(torch.ones(1))]}, {"params": [torch.nn.Parameter(torch.ones(1))]}], **kw
    )


def run(sched, opt, steps):
    """(lrs, momenta) of both groups after construction and after each of `steps` steps."""
    key = "betas" if "betas" in opt.param_groups[0] else "momentum"
    out = [([g["lr"] for g in opt.param_groups], [g[key] for g in opt.param_groups])]
    for _ in range(steps):
        sched.step()
        out.append(([g["lr"] for g in opt.param_groups], [g[key] for g in opt.param_groups]))
    return [lr for lr, _ in out], [m for _, m in out]


# "ONECYCLE_ADAM" line: Adam(betas=(0.9, 0.99)) so that DeepSpeed's hard-coded beta2 = 0.99 is the group's too.
DS_ONECYCLE_LRS = [
    [0.1, 0.2],
    [0.3250000000000002, 0.6500000000000004],
    [0.5499999999999999, 1.0999999999999999],
    [0.7750000000000001, 1.5500000000000003],
    [0.9999999999999998, 1.9999999999999996],
    [0.85, 1.7],
    [0.6999999999999998, 1.3999999999999997],
    [0.5500000000000002, 1.1000000000000003],
    [0.3999999999999999, 0.7999999999999998],
    [0.2500000000000001, 0.5000000000000002],
    [0.1, 0.2],
    [0.08, 0.16],
    [0.06666666666666667, 0.13333333333333333],
    [0.05714285714285715, 0.1142857142857143],
    [0.05, 0.1],
    [0.044444444444444446, 0.08888888888888889],
    [0.04, 0.08],
    [0.03636363636363637, 0.07272727272727274],
    [0.03333333333333333, 0.06666666666666667],
    [0.03076923076923077, 0.06153846153846154],
    [0.028571428571428574, 0.05714285714285715],
]
DS_ONECYCLE_BETA1 = [
    [0.8, 0.7],
    [0.875, 0.8875],
    [0.8500000000000001, 0.825],
    [0.8250000000000001, 0.7625],
    [0.8, 0.7],
    [0.8166666666666667, 0.7416666666666666],
    [0.8333333333333334, 0.7833333333333333],
    [0.85, 0.825],
    [0.8666666666666667, 0.8666666666666667],
    [0.8833333333333333, 0.9083333333333332],
    [0.9, 0.95],
    [0.9045, 0.9547499999999999],
    [0.909, 0.9594999999999999],
    [0.9135, 0.9642499999999998],
    [0.918, 0.969],
    [0.9225, 0.9737499999999999],
    [0.927, 0.9784999999999999],
    [0.9315, 0.9832499999999998],
    [0.936, 0.988],
    [0.9405, 0.9927499999999999],
    [0.9450000000000001, 0.9974999999999999],
]
DS_ONECYCLE_GET_MOM = [(0.9450000000000001, 0.99), (0.9974999999999999, 0.99)]


def test_one_cycle_per_group_lists_match_deepspeed_to_the_bit():
    opt = two_groups(torch.optim.Adam, lr=1.0, betas=(0.9, 0.99))
    sched = OneCycle(
        opt,
        cycle_min_lr=[0.1, 0.2],
        cycle_max_lr=[1.0, 2.0],
        decay_lr_rate=0.5,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        cycle_min_mom=[0.8, 0.7],
        cycle_max_mom=[0.9, 0.95],
        decay_mom_rate=0.01,
    )
    lrs, betas = run(sched, opt, 20)
    assert lrs == DS_ONECYCLE_LRS
    assert betas == [[(b0, 0.99) for b0 in row] for row in DS_ONECYCLE_BETA1]
    assert sched.get_mom() == DS_ONECYCLE_GET_MOM


def test_one_cycle_keeps_each_groups_beta2_on_purpose():
    # "ONECYCLE_BETA2": with Adam(betas=(0.9, 0.999)) DeepSpeed writes (0.8, 0.99) at construction and
    # get_mom() is [(0.9, 0.99)] * 2. Ours: the same beta1, beta2 kept at 0.999 (a DeepSpeed bug).
    opt = two_groups(torch.optim.Adam, lr=1.0, betas=(0.9, 0.999))
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    assert opt.param_groups[0]["betas"] == (0.8, 0.999)
    assert sched.get_mom() == [(0.9, 0.999), (0.9, 0.999)]


# "ONECYCLE_SGD": DeepSpeed disables cycle_momentum (no 'betas' in SGD's defaults) with a warning.
DS_ONECYCLE_SGD_LRS = [
    0.1,
    0.40000000000000013,
    0.6999999999999998,
    1.0,
    0.7000000000000003,
    0.3999999999999998,
    0.1,
    0.1,
    0.1,
]


def test_one_cycle_sgd_momentum_is_not_cycled(caplog):
    opt = two_groups(torch.optim.SGD, lr=1.0, momentum=0.5)
    with caplog.at_level(logging.WARNING):
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=3)
    assert "cycle_momentum is disabled" in caplog.text
    assert sched.cycle_momentum is False and sched.get_mom() is None
    lrs, moms = run(sched, opt, 8)
    assert lrs == [[lr, lr] for lr in DS_ONECYCLE_SGD_LRS]
    assert moms == [[0.5, 0.5]] * 9


# "ONECYCLE_SECOND0 stairs 0 / 2": cycle_second_step_size=0 is accepted (a sawtooth), 4 + 0 steps, 0 -> 1.
DS_SECOND0 = {
    0: ([0.0, 0.25, 0.5, 0.75] + [0.0] * 7, [0.8, 0.875, 0.8500000000000001, 0.8250000000000001] + [0.9] * 7),
    2: ([0.0, 0.0, 0.5, 0.5] + [0.0] * 7, [0.8, 0.9, 0.8500000000000001, 0.8500000000000001] + [0.9] * 7),
}


@pytest.mark.parametrize("stairs", sorted(DS_SECOND0))
def test_one_cycle_second_step_size_zero_is_deepspeeds_sawtooth(caplog, stairs):
    opt = two_groups(torch.optim.Adam, lr=1.0, betas=(0.9, 0.99))
    with caplog.at_level(logging.WARNING):
        sched = OneCycle(
            opt,
            cycle_min_lr=0.0,
            cycle_max_lr=1.0,
            cycle_first_step_size=4,
            cycle_second_step_size=0,
            cycle_first_stair_count=stairs,
        )
    assert "cycle_second_step_size is 0" in caplog.text
    lrs, betas = run(sched, opt, 10)
    assert [row[0] for row in lrs] == DS_SECOND0[stairs][0]
    assert [row[0] for row in betas] == [(b, 0.99) for b in DS_SECOND0[stairs][1]]


# "BAD ..." lines: DeepSpeed's ValueErrors (ours are ConfigError, a ValueError, naming the key).
@pytest.mark.parametrize(
    "bad, key",
    [
        ({"cycle_min_lr": [0.1]}, "cycle_min_lr"),
        ({"cycle_min_mom": [0.8, 0.7, 0.6]}, "cycle_min_mom"),
        ({"cycle_second_step_size": -1}, "cycle_second_step_size"),
    ],
)
def test_one_cycle_bad_values_are_value_errors(bad, key):
    with pytest.raises(ValueError, match=f"scheduler.params.{key}"):
        OneCycle(two_groups(torch.optim.Adam), **{"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, **bad})


# "WARMUP_LISTS", "WARMUP_UNKNOWN", "WARMUPDECAY_LISTS", "WARMUPCOSINE" lines.
DS_WARMUP_LOG = [
    0.0,
    0.0,
    0.30102999566398114,
    0.4771212547196624,
    0.6020599913279623,
    0.6989700043360186,
    0.7781512503836435,
    0.8450980400142567,
    0.9030899869919433,
    0.9542425094393248,
    0.9999999999999999,
    1.0,
    1.0,
]
DS_WARMUP_LISTS = [
    [0.0, 0.1],
    [0.0, 0.1],
    [0.30102999566398114, 0.22041199826559246],
    [0.4771212547196624, 0.29084850188786493],
    [0.6020599913279623, 0.3408239965311849],
    [0.6989700043360186, 0.37958800173440743],
    [0.7781512503836435, 0.4112605001534574],
    [0.8450980400142567, 0.4380392160057027],
    [0.9030899869919433, 0.46123599479677735],
    [0.9542425094393248, 0.4816970037757299],
    [0.9999999999999999, 0.5],
    [1.0, 0.5],
    [1.0, 0.5],
]
DS_WARMUPDECAY_LISTS = [
    [0.0, 0.1],
    [0.0, 0.1],
    [0.25, 0.2],
    [0.5, 0.30000000000000004],
    [0.75, 0.4],
    [1.0, 0.5],
    [0.9166666666666666, 0.4666666666666667],
    [0.8333333333333334, 0.43333333333333335],
    [0.75, 0.4],
    [0.6666666666666666, 0.3666666666666667],
    [0.5833333333333334, 0.33333333333333337],
    [0.5, 0.30000000000000004],
    [0.4166666666666667, 0.2666666666666667],
    [0.3333333333333333, 0.23333333333333334],
    [0.25, 0.2],
    [0.16666666666666666, 0.16666666666666669],
    [0.08333333333333333, 0.13333333333333333],
    [0.0, 0.1],
    [0.0, 0.1],
]
DS_WARMUPCOSINE = [
    [0.0, 0.0],
    [0.1, 0.05],
    [0.4876089022660538, 0.2438044511330269],
    [0.7143455750373868, 0.3571727875186934],
    [0.8752178045321075, 0.43760890226605376],
    [1.0, 0.5],
    [0.9504893855078144, 0.4752446927539072],
    [0.8117637264392739, 0.40588186321963693],
    [0.6112993409314593, 0.30564967046572966],
    [0.38880065906854067, 0.19440032953427033],
    [0.1883362735607262, 0.0941681367803631],
    [0.04961061449218561, 0.024805307246092805],
    [0.0001, 5e-05],
    [0.0001, 5e-05],
    [0.0001, 5e-05],
]


def test_warmup_lr_per_group_lists():
    opt = two_groups(torch.optim.SGD, lr=1.0)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=10)
    assert run(sched, opt, 12)[0] == DS_WARMUP_LISTS


def test_unknown_warmup_type_warms_up_as_log(caplog):
    opt = two_groups(torch.optim.SGD, lr=1.0)
    with caplog.at_level(logging.WARNING):
        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
    assert "warmup_type 'cosine'" in caplog.text and sched.warmup_type == "log"
    assert run(sched, opt, 12)[0] == [[lr, lr] for lr in DS_WARMUP_LOG]
    for cls, kw in ((WarmupDecayLR, {"total_num_steps": 20}), (WarmupCosineLR, {"total_num_steps": 20})):
        assert cls(two_groups(torch.optim.SGD, lr=1.0), warmup_type="exp", **kw).warmup_type == "log"


def test_warmup_decay_lr_per_group_lists():
    opt = two_groups(torch.optim.SGD, lr=1.0)
    sched = WarmupDecayLR(
        opt,
        total_num_steps=16,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.5],
        warmup_num_steps=4,
        warmup_type="linear",
    )
    assert run(sched, opt, 18)[0] == DS_WARMUPDECAY_LISTS


def test_warmup_cosine_lr_per_group_base_lrs():
    opt = torch.optim.SGD(
        [
            {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1.0},
            {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.5},
        ]
    )
    sched = WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=5, warmup_min_ratio=0.1)
    assert run(sched, opt, 14)[0] == DS_WARMUPCOSINE


# ------------------------------------------------------------------ 5. training_data order

# "SHARD world drop_last rank plain pipe" lines: 10 samples, micro batch 2; plain = deepspeed_io's
# DeepSpeedDataLoader (DistributedSampler shuffle=True seed=0), pipe = PipelineEngine._build_data_iter's
# (DistributedSampler shuffle=False). The sampler pads to a multiple of the world size in both.
DS_SHARDS = {
    (3, False): (
        [[[4, 5], [0, 2]], [[1, 3], [8, 4]], [[7, 9], [6, 1]]],
        [[[0, 3], [6, 9]], [[1, 4], [7, 0]], [[2, 5], [8, 1]]],
    ),
    (4, False): (
        [[[4, 3], [6]], [[1, 9], [2]], [[7, 0], [4]], [[5, 8], [1]]],
        [[[0, 4], [8]], [[1, 5], [9]], [[2, 6], [0]], [[3, 7], [1]]],
    ),
    (4, True): ([[[4, 3]], [[1, 9]], [[7, 0]], [[5, 8]]], [[[0, 4]], [[1, 5]], [[2, 6]], [[3, 7]]]),
}
DS_SHARDS[(3, True)] = DS_SHARDS[(3, False)]  # 12 padded indices: every rank has 2 full micro-batches
DATA = torch.utils.data.TensorDataset(torch.arange(10))


def _ids(loader):
    return [b[0].tolist() for b in loader]


@pytest.mark.parametrize("world, drop_last", sorted(DS_SHARDS))
@pytest.mark.parametrize("pipeline", [False, True])
def test_training_loader_reads_deepspeeds_indices(world, drop_last, pipeline):
    expected = DS_SHARDS[(world, drop_last)][pipeline]
    for rank in range(world):
        loader = build_training_loader(DATA, 2, rank=rank, world_size=world, pipeline=pipeline, drop_last=drop_last)
        assert _ids(loader) == expected[rank]
        assert len(loader) == len(expected[rank])


# "ENGINE_LOADER" line: deepspeed.initialize(training_data=...) on one process; DeepSpeed repeats this
# order in every epoch (no set_epoch); ours shuffles each later epoch anew (on purpose).
DS_ENGINE_ORDER = [[4, 1], [7, 5], [3, 9], [0, 8], [6, 2]]
# "PIPE_LOADER" line: the pipeline engine's RepeatingLoader over 7 micro-batches.
DS_PIPE_ORDER = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 1], [2, 3]]


def test_initialize_training_data_is_deepspeeds_first_epoch():
    model = torch.nn.Linear(1, 1)
    _, _, loader, _ = zerospeed.initialize(
        model=model,
        training_data=DATA,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        },
    )
    assert _ids(loader) == DS_ENGINE_ORDER
    second = _ids(loader)
    assert second != DS_ENGINE_ORDER and sorted(i for batch in second for i in batch) == list(range(10))


def test_initialize_pipeline_training_data_is_read_in_order():
    module = PipelineModule([torch.nn.Linear(1, 1)], num_stages=1, loss_fn=torch.nn.MSELoss())
    engine, *_ = zerospeed.initialize(
        model=module, training_data=DATA, config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    )
    stream = iter(RepeatingLoader(engine.training_dataloader))
    assert [next(stream)[0].tolist() for _ in range(7)] == DS_PIPE_ORDER


# ------------------------------------------------------------------ the DeepSpeed script (not run here)
#
# DS_ACCELERATOR=cpu python ds_reference.py   (DeepSpeed 0.19.8 with huggingface_hub and safetensors, torch CPU)
#
# import inspect, json, os, torch
# os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
# import deepspeed
# from deepspeed.utils import zero_to_fp32 as z
# from deepspeed.runtime.config import DeepSpeedConfig
# from deepspeed.runtime.dataloader import DeepSpeedDataLoader
# from deepspeed.runtime.lr_schedules import OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR
# from deepspeed.pipe import PipelineModule
# for f in ("convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
#           "load_state_dict_from_zero_checkpoint"):
#     print("SIG", f, inspect.signature(getattr(z, f)))
# torch.manual_seed(0)
# model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
# cfg = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
#        "zero_optimization": {"stage": 2}}
# engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
# engine.backward(engine(torch.randn(2, 4)).sum()); engine.step()
# engine.save_checkpoint("ck")
# for kw in ({}, {"safe_serialization": True}, {"max_shard_size": 100}, {"max_shard_size": 100,
# "safe_serialization": True}):
#     out = "conv_" + "_".join(f"{k}{v}" for k, v in kw.items())
#     ret = z.convert_zero_checkpoint_to_fp32_state_dict("ck", out, **kw)
#     index = [json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.endswith(".json")]
#     print("CONVERT", kw, ret, sorted(os.listdir(out)), index)
# for bad in ("", None):
#     try:
#         engine.save_checkpoint(bad)
#     except Exception as e:
#         print("SAVE", repr(bad), type(e).__name__, e)
# try:
#     engine.load_checkpoint(None)
# except Exception as e:
#     print("LOAD None", type(e).__name__, e)
# print("LOAD ''", engine.load_checkpoint(""))  # no ./latest: a warning and (None, None)
# try:
#     DeepSpeedConfig({"train_batch_size": 2, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
# except Exception as e:
#     print("ALLREDUCE", type(e).__name__, e)
# print("ALLREDUCE stage 2", DeepSpeedConfig({"train_batch_size": 2, "gradient_allreduce_op": "sum",
#                                             "zero_optimization": {"stage": 2}}).gradient_allreduce_op)
#
# def groups():
#     return [{"params": [torch.nn.Parameter(torch.ones(1))]}, {"params": [torch.nn.Parameter(torch.ones(1))]}]
#
# def run(s, opt, n):
#     key = "betas" if "betas" in opt.param_groups[0] else "momentum"
#     rec = lambda: ([g["lr"] for g in opt.param_groups], [g[key] for g in opt.param_groups])
#     out = [rec()]
#     for _ in range(n):
#         s.step()
#         out.append(rec())
#     return [lr for lr, _ in out], [m for _, m in out]
#
# opt = torch.optim.Adam(groups(), lr=1.0, betas=(0.9, 0.99))
# s = OneCycle(opt, cycle_min_lr=[0.1, 0.2], cycle_max_lr=[1.0, 2.0], decay_lr_rate=0.5, cycle_first_step_size=4,
#              cycle_second_step_size=6, decay_step_size=2, cycle_min_mom=[0.8, 0.7], cycle_max_mom=[0.9, 0.95],
#              decay_mom_rate=0.01)
# print("ONECYCLE_ADAM", run(s, opt, 20), "get_mom", s.get_mom())
# opt = torch.optim.Adam(groups(), lr=1.0, betas=(0.9, 0.999))
# s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
# print("ONECYCLE_BETA2", opt.param_groups[0]["betas"], s.get_mom())
# opt = torch.optim.SGD(groups(), lr=1.0, momentum=0.5)
# s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=3)
# print("ONECYCLE_SGD", s.cycle_momentum, s.get_mom(), run(s, opt, 8))
# for stairs in (0, 2):
#     opt = torch.optim.Adam(groups(), lr=1.0, betas=(0.9, 0.99))
#     s = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=0,
#                  cycle_first_stair_count=stairs)
#     print("ONECYCLE_SECOND0 stairs", stairs, run(s, opt, 10))
# opt = torch.optim.SGD(groups(), lr=1.0)
# print("WARMUP_LISTS", run(WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=10),
# opt, 12)[0])
# opt = torch.optim.SGD(groups(), lr=1.0)
# s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
# print("WARMUP_UNKNOWN", s.warmup_type, run(s, opt, 12)[0])
# opt = torch.optim.SGD(groups(), lr=1.0)
# s = WarmupDecayLR(opt, total_num_steps=16, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=4,
#                   warmup_type="linear")
# print("WARMUPDECAY_LISTS", run(s, opt, 18)[0])
# opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1.0},
#                        {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.5}])
# print("WARMUPCOSINE", run(WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=5, warmup_min_ratio=0.1), opt,
# 14)[0])
# for bad in ({"cycle_min_lr": [0.1]}, {"cycle_min_mom": [0.8, 0.7, 0.6]}, {"cycle_second_step_size": -1}):
#     try:
#         OneCycle(torch.optim.Adam(groups()), **{"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, **bad})
#     except Exception as e:
#         print("BAD", bad, type(e).__name__, e)
#
# data = torch.utils.data.TensorDataset(torch.arange(10))
# m = torch.nn.Linear(1, 1)
# cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
#        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
# _, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg, training_data=data)
# sm = loader.data_sampler
# print("ENGINE_LOADER", type(sm).__name__, sm.shuffle, sm.seed, sm.drop_last, [b[0].tolist() for b in loader],
#       [b[0].tolist() for b in loader])
# pm = PipelineModule(layers=[torch.nn.Linear(1, 1)], num_stages=1, loss_fn=torch.nn.MSELoss())
# peng, _, ploader, _ = deepspeed.initialize(model=pm, model_parameters=pm.parameters(), config=cfg, training_data=data)
# ps = ploader.loader.data_sampler
# print("PIPE_LOADER", type(ploader).__name__, type(ps).__name__, ps.shuffle, [next(ploader)[0].tolist() for _ in
# range(7)])
# for world in (3, 4):
#     for drop in (False, True):
#         for r in range(world):
#             kw = dict(batch_size=2, pin_memory=False, local_rank=0, tput_timer=None, data_parallel_world_size=world,
#                       data_parallel_rank=r, dataloader_drop_last=drop)
#             plain = DeepSpeedDataLoader(data, **kw)  # deepspeed_io's loader (data_sampler None)
#             pipe = DeepSpeedDataLoader(data, data_sampler=torch.utils.data.distributed.DistributedSampler(
#                 data, num_replicas=world, rank=r, shuffle=False), **kw)  # PipelineEngine._build_data_iter's
#             print("SHARD", world, drop, r, [b[0].tolist() for b in plain], [b[0].tolist() for b in pipe])


# DeepSpeed 0.19.8: DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "cpu", "pipeline_write": True})
# read through its field names (the stage3_* keys are their aliases) gives these values.
DS_ZERO3_FIELD_VALUES = {
    "prefetch_bucket_size": 50000000,
    "param_persistence_threshold": 100000,
    "model_persistence_threshold": 9223372036854775807,
    "max_live_parameters": 1000000000,
    "max_reuse_distance": 1000000000,
    "gather_16bit_weights_on_model_save": False,
    "module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False,
    "allgather_sequential": False,
}


def test_zero_config_answers_to_deepspeeds_field_names():
    from zerospeed.config import parse_config

    zero = parse_config(
        {
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_write": True}},
        }
    ).zero_optimization
    assert {name: getattr(zero, name) for name in DS_ZERO3_FIELD_VALUES} == DS_ZERO3_FIELD_VALUES
    assert zero.offload_optimizer.pipeline is True  # DeepSpeed: pipeline_read or pipeline_write
    zero = parse_config(
        {
            "train_batch_size": 2,
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 123,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
        }
    ).zero_optimization
    assert (zero.prefetch_bucket_size, zero.gather_16bit_weights_on_model_save) == (123, True)
