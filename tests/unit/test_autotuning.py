"""The autotuner's pure parts: tuning space, estimator pruning, searches, results, command lines, and
the orchestration with a fake trial runner (no processes)."""

import json
from pathlib import Path

import pytest

from zerospeed.autotuning import command as cmd
from zerospeed.autotuning.autotuner import Autotuner, AutotuningError, _timeout_rule, parse_bytes
from zerospeed.autotuning.planner import DOMINATED, OK, PRUNED, ModelInfo, device_bytes, grid_order, min_memory, plan
from zerospeed.autotuning.results import Record, best_record, summary, table_rows, write_optimal, write_results
from zerospeed.autotuning.space import (
    Candidate,
    micro_batch_ladder,
    micro_batches,
    split_space,
    spread,
    traffic,
    trial_config,
    valid,
)
from zerospeed.autotuning.trial import TrialResult, trial_timeout
from zerospeed.autotuning.tuner import better, drive, make_search, model_based, ordered
from zerospeed.config import ConfigError, parse_config
from zerospeed.config.validation import validate_config
from zerospeed.estimate.formulas import Option, Precision, placed_model_states
from zerospeed.launcher.environment import UserCommand


def at(**kw):
    return validate_config({"autotuning": kw}).autotuning


# -- the config block -----------------------------------------------------------------------------------
def test_block_has_deepspeeds_defaults_and_is_strict():
    a = at()
    assert (a.enabled, a.fast, a.results_dir, a.exps_dir, a.overwrite, a.metric) == (
        False,
        True,
        "autotuning_results",
        "autotuning_exps",
        True,
        "throughput",
    )
    assert (a.start_profile_step, a.end_profile_step, a.tuner_type, a.tuner_early_stopping, a.tuner_num_trials) == (
        3,
        5,
        "gridsearch",
        5,
        50,
    )
    assert (
        a.max_train_batch_size,
        a.min_train_batch_size,
        a.max_train_micro_batch_size_per_gpu,
        a.min_train_micro_batch_size_per_gpu,
        a.num_tuning_micro_batch_sizes,
        a.mp_size,
    ) == (None, 1, 1024, 1, 3, 1)
    with pytest.raises(ConfigError, match="autotuning.tuner_typ"):
        at(tuner_typ="random")
    with pytest.raises(ConfigError, match="autotuning.metric"):
        at(metric="speed")


def test_enabled_block_is_accepted_and_ignored_by_a_training_config():
    cfg = parse_config({"train_batch_size": 4, "autotuning": {"enabled": True, "metric": "latency"}})
    assert cfg.autotuning.enabled and cfg.autotuning.metric == "latency"


# -- the tuning space ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "zero, stages",
    [
        (None, (0,)),
        ({"stage": 2}, (2,)),
        ({"stage": [3, 1]}, (1, 3)),
        ({"stage": "all"}, (0, 1, 2, 3)),
        ({"stage": ["all"]}, (0, 1, 2, 3)),
    ],
)
def test_stages_follow_deepspeeds_convention(zero, stages):
    raw = {} if zero is None else {"zero_optimization": zero}
    base, space = split_space(raw, at())
    assert space.stages == stages and "stage" not in base.get("zero_optimization", {})


def test_bad_stage_is_a_config_error():
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=\[4\]"):
        split_space({"zero_optimization": {"stage": [4]}}, at())


def test_micro_batch_list_number_and_auto():
    _, s = split_space({"train_micro_batch_size_per_gpu": [8, 2, 2]}, at())
    assert s.micro_batches == (2, 8)
    _, s = split_space({"train_micro_batch_size_per_gpu": 4}, at(max_train_micro_batch_size_per_gpu=64))
    assert (s.micro_batches, s.min_micro_batch, s.max_micro_batch) == (None, 4, 64)  # a number is the smallest
    _, s = split_space(
        {"train_micro_batch_size_per_gpu": "auto"},
        at(min_train_micro_batch_size_per_gpu=3),
        script_values={"train_micro_batch_size_per_gpu": 5},
    )
    assert s.min_micro_batch == 5
    _, s = split_space({}, at(min_train_micro_batch_size_per_gpu=3))
    assert s.min_micro_batch == 3


def test_batch_keys_leave_the_base_and_come_back_per_candidate():
    raw = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": [1, 2],
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam"},
        "zero_optimization": {
            "stage": [1, 2],
            "overlap_comm": True,
            "offload_optimizer": {"device": ["none", "cpu"], "pin_memory": True},
        },
    }
    base, space = split_space(raw, at())
    assert not set(base) & {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    assert space.gas == 4 and space.offload_optimizer == ("none", "cpu")
    cfg = trial_config(base, Candidate(2, 2, 4, "cpu"), {"metric_path": "m.json"})
    assert cfg["zero_optimization"] == {
        "stage": 2,
        "overlap_comm": True,
        "offload_optimizer": {"pin_memory": True, "device": "cpu"},
    }
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert cfg["autotuning"] == {"metric_path": "m.json"}
    assert "offload_optimizer" not in trial_config(base, Candidate(1, 2, 4))["zero_optimization"]
    assert raw["zero_optimization"]["stage"] == [1, 2]  # the user's dict is not changed
    parse_config(cfg)  # a trial's config is a valid config


def test_knobs_need_fast_false():
    raw = {"zero_optimization": {"stage": 2, "reduce_bucket_size": [5e7, 5e8]}}
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size: .*autotuning.fast: false"):
        split_space(raw, at())
    base, space = split_space(raw, at(fast=False))
    assert space.knobs == (("reduce_bucket_size", (5e7, 5e8)),)
    rows = plan(space, None, None)
    assert [r.candidate.name for r in rows if r.candidate.micro_batch == 1] == [
        "z2_tmbspg1_gas1_reduce_bucket_size-5e07",
        "z2_tmbspg1_gas1_reduce_bucket_size-5e08",
    ]


def test_gas_list_is_refused():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: a list"):
        split_space({"gradient_accumulation_steps": [1, 2]}, at())


def test_ladder_spread_and_names():
    assert micro_batch_ladder(1, 8) == [1, 2, 4, 8]
    assert micro_batch_ladder(3, 20) == [3, 6, 12, 20]
    assert micro_batch_ladder(4, 2) == []
    assert spread([1, 2, 4, 8, 16, 32, 64], 3) == [1, 8, 64]
    assert spread([1, 2], 5) == [1, 2] and spread([1, 2, 4], 1) == [4] and spread([], 2) == []
    assert Candidate(1, 3, 1).name == "z1_tmbspg3_gas1"
    assert Candidate(3, 2, 2, "cpu", "cpu").name == "z3_tmbspg2_gas2_offopt-cpu_offparam-cpu"
    assert not valid(Candidate(0, 1, 1, "cpu")) and not valid(Candidate(2, 1, 1, "cpu", "cpu"))
    assert not valid(Candidate(3, 1, 1, "none", "cpu")) and valid(Candidate(3, 1, 1, "cpu", "cpu"))


def test_train_batch_bounds_limit_the_micro_batches():
    _, s = split_space(
        {"gradient_accumulation_steps": 2},
        at(max_train_micro_batch_size_per_gpu=64, max_train_batch_size=64, min_train_batch_size=8),
    )
    assert micro_batches(s, dp_size=4) == [1, 2, 4, 8]  # 8 x 2 x 4 = 64; 1 x 2 x 4 = 8
    assert micro_batches(s, dp_size=8) == [1, 2, 4]


# -- the planner -----------------------------------------------------------------------------------------
MIXED = Precision.of("fp16", "adam")  # 2 + 2 + 4 + 8 bytes per parameter
INFO = ModelInfo(
    num_params=10**8, largest_layer_params=10**7, precision=MIXED, activation_bytes_per_sample=2**28, dp_size=4
)  # 256 MiB per sample


def test_device_bytes_is_the_estimators_model_states_plus_activations():
    for c in (Candidate(0, 2), Candidate(2, 4), Candidate(3, 1), Candidate(3, 2, 1, "cpu", "cpu")):
        states = placed_model_states(
            10**8, 4, Option(c.stage, c.offload_optimizer != "none", c.offload_param != "none"), MIXED, 10**7
        )["device"]
        assert device_bytes(c, INFO) == pytest.approx(sum(states.values()) + 2**28 * c.micro_batch)
    # stage 0: 16 bytes/param = 1.6 GB of model states; stage 3: 16/4 = 0.4 GB
    assert device_bytes(Candidate(0, 1), INFO) == pytest.approx(16e8 + 2**28)
    assert device_bytes(Candidate(3, 1), INFO) == pytest.approx(4e8 + 2**28)


def test_estimator_prunes_what_cannot_fit_and_marks_dominated_before_any_trial():
    _, space = split_space(
        {"zero_optimization": {"stage": "all"}, "train_micro_batch_size_per_gpu": [1, 2, 4, 8]}, at()
    )
    # per rank (dp 4) model states: stage 0 16 bytes/param = 1.6e9, stage 1 2+2+12/4 = 0.7e9, stage 2
    # 2+14/4 = 0.55e9, stage 3 16/4 = 0.4e9; activations 2**28 = 0.268e9 per sample
    rows = {r.candidate.name: r for r in plan(space, INFO, 3e9)}
    assert {n for n, r in rows.items() if r.status == PRUNED} == {"z0_tmbspg8_gas1"}  # 1.6e9 + 8 x 0.268e9
    assert rows["z0_tmbspg8_gas1"].note == "estimate 3.49 GiB > budget 2.79 GiB"
    assert {n for n, r in rows.items() if r.status == OK} == {
        f"z{s}_tmbspg{m}_gas1" for s in (0, 1, 2) for m in (1, 2, 4, 8)
    } - {"z0_tmbspg8_gas1"}
    # stage 3 is kept only where no stage 0-2 fits: here nowhere
    assert {n for n, r in rows.items() if r.status == DOMINATED} == {f"z3_tmbspg{m}_gas1" for m in (1, 2, 4, 8)}
    assert rows["z3_tmbspg8_gas1"].dominated_by == Candidate(1, 8)
    assert rows["z3_tmbspg4_gas1"].dominated_by == Candidate(0, 4)
    # a tighter budget: only stage 3 fits micro batch 8 (2.55e9), so it survives there
    rows = {r.candidate.name: r.status for r in plan(space, INFO, 2.6e9)}
    assert [rows[f"z{s}_tmbspg8_gas1"] for s in range(4)] == [PRUNED, PRUNED, PRUNED, OK]
    assert rows["z3_tmbspg4_gas1"] == DOMINATED


def test_tiers_follow_the_bytes_each_stage_moves():
    assert [traffic(s, 1) for s in range(4)] == [2, 2, 2, 3]  # the ZeRO paper
    assert [traffic(s, 2) for s in range(4)] == [2, 2, 3, 6]  # stage 2 reduce-scatters every micro-step
    assert Candidate(1, 8, 2).tier == Candidate(0, 8, 2).tier < Candidate(2, 8, 2).tier < Candidate(3, 8, 2).tier
    assert Candidate(3, 8, 1).tier < Candidate(1, 8, 1, "cpu").tier < Candidate(3, 8, 1, "cpu", "cpu").tier
    # with accumulation, stage 2 is dominated where stage 0 or 1 fits
    _, space = split_space(
        {
            "zero_optimization": {"stage": "all"},
            "train_micro_batch_size_per_gpu": [8],
            "gradient_accumulation_steps": 2,
        },
        at(),
    )
    rows = {r.candidate.name: r for r in plan(space, INFO, 3.5e9)}
    assert {n: r.status for n, r in rows.items()} == {
        "z0_tmbspg8_gas2": PRUNED,
        "z1_tmbspg8_gas2": OK,
        "z2_tmbspg8_gas2": DOMINATED,
        "z3_tmbspg8_gas2": DOMINATED,
    }
    assert rows["z2_tmbspg8_gas2"].note == (
        "z1_tmbspg8_gas2 fits the same micro batch and moves less (2x the model per step vs 3x the model per step)"
    )


def test_ladder_keeps_a_spread_of_the_sizes_that_fit_per_stage():
    _, space = split_space(
        {"zero_optimization": {"stage": [0, 3]}},
        at(max_train_micro_batch_size_per_gpu=1024, num_tuning_micro_batch_sizes=3),
    )
    rows = plan(space, INFO, 6e9, prune_dominated=False)
    kept = {(r.candidate.stage, r.candidate.micro_batch) for r in rows if r.status == OK}
    # stage 0 fits up to (6e9 - 1.6e9) / 2**28 = 16.4 -> 16; stage 3 up to 20.8 -> 16 too (the ladder doubles)
    assert kept == {(0, 1), (0, 4), (0, 16), (3, 1), (3, 4), (3, 16)}
    assert {r.candidate.micro_batch for r in rows if r.status == PRUNED and r.candidate.stage == 0} == {
        32,
        64,
        128,
        256,
        512,
        1024,
    }


def test_no_info_no_budget_means_every_candidate():
    _, space = split_space(
        {"zero_optimization": {"stage": "all"}, "train_micro_batch_size_per_gpu": [1, 2, 4, 8]}, at()
    )
    rows = plan(space, None, None, prune_dominated=False)
    assert len(rows) == 16 and all(r.status == OK for r in rows)
    assert [r.candidate.name for r in rows[:4]] == [
        "z0_tmbspg8_gas1",
        "z1_tmbspg8_gas1",
        "z2_tmbspg8_gas1",
        "z0_tmbspg4_gas1",
    ]
    assert rows[-1].candidate.name == "z3_tmbspg1_gas1"
    assert min_memory(space) == Candidate(3, 1)


def test_grid_order_is_tier_then_largest_micro_batch():
    rows = grid_order(
        [
            p
            for p in plan(
                split_space(
                    {
                        "zero_optimization": {"stage": [1, 3], "offload_optimizer": {"device": ["none", "cpu"]}},
                        "train_micro_batch_size_per_gpu": [1, 2],
                    },
                    at(),
                )[1],
                None,
                None,
                prune_dominated=False,
            )
        ]
    )
    assert [r.candidate.name for r in rows] == [
        "z1_tmbspg2_gas1",
        "z1_tmbspg1_gas1",
        "z3_tmbspg2_gas1",
        "z3_tmbspg1_gas1",
        "z1_tmbspg2_gas1_offopt-cpu",
        "z1_tmbspg1_gas1_offopt-cpu",
        "z3_tmbspg2_gas1_offopt-cpu",
        "z3_tmbspg1_gas1_offopt-cpu",
    ]


def test_model_info_from_the_profile_run():
    info = {
        "num_params": 1000,
        "largest_layer_params": 100,
        "param_bytes": 2,
        "grad_bytes": 4,
        "master_bytes": 4,
        "optim_bytes": 8,
        "activation_bytes": 4096,
        "micro_batch": 2,
        "dp_world_size": 4,
        "local_size": 2,
        "device": "cpu",
        "device_memory": 8 * 2**30,
    }
    m = ModelInfo.from_profile(info, mp_size=2)
    assert (m.num_params, m.largest_layer_params, m.precision, m.activation_bytes_per_sample, m.dp_size) == (
        1000,
        100,
        Precision(2, 4, 4, 8),
        2048,
        2,
    )
    assert m.device_memory_per_rank == 4 * 2**30  # two ranks share the host
    assert ModelInfo.from_profile({**info, "device": "cuda"}).device_memory_per_rank == 8 * 2**30


# -- the searches -------------------------------------------------------------------------------------------
def run(search, values, max_trials=100):
    return [c.name for c in drive(search, lambda c: values.get(c.name), max_trials)]


GRID = [Candidate(s, m) for m in (8, 4, 2, 1) for s in (0, 1, 2)]


def test_ordered_stops_early_stopping_trials_after_the_best():
    values = {c.name: 10.0 - i for i, c in enumerate(GRID)}  # the first is best
    assert run(ordered(GRID, "throughput", 2), values) == [c.name for c in GRID[:3]]
    values[GRID[2].name] = 20.0
    assert run(ordered(GRID, "throughput", 2), values) == [c.name for c in GRID[:5]]
    assert len(run(ordered(GRID, "throughput", None), values)) == len(GRID)
    assert len(run(ordered(GRID, "throughput", None), values, max_trials=5)) == 5


def test_failures_never_stop_a_search_nor_count_as_the_best():
    values = {GRID[2].name: 5.0}  # everything else fails (None)
    assert run(ordered(GRID, "throughput", 1), values) == [c.name for c in GRID[:4]]


def test_latency_is_lower_is_better():
    assert better(1.0, 2.0, "latency") and not better(1.0, 2.0, "throughput") and better(2.0, 1.0, "flops")


def test_model_based_descends_the_micro_batch_then_tries_the_other_stages():
    # throughput grows with the micro batch; stage 1 is a little faster than 0, stage 2 slower than 1
    speed = {0: 1.0, 1: 1.05, 2: 1.02, 3: 0.7}
    values = {Candidate(s, m).name: speed[s] * m / (m + 2) for s in range(4) for m in (1, 2, 4, 8)}
    cands = [Candidate(s, m) for s in range(4) for m in (1, 2, 4, 8)]
    tried = run(model_based(cands, "throughput"), values)
    # stage 0 from 8 down: 4 is worse -> micro batch 8; then stages 1 (better), 2 (worse: stop); then tier 1
    # (stage 3) is searched and is no better -> stop
    assert tried == [
        "z0_tmbspg8_gas1",
        "z0_tmbspg4_gas1",
        "z1_tmbspg8_gas1",
        "z2_tmbspg8_gas1",
        "z3_tmbspg8_gas1",
        "z3_tmbspg4_gas1",
    ]


def test_model_based_skips_failed_trials_and_finds_a_peak_inside():
    values = {"z0_tmbspg4_gas1": 3.0, "z0_tmbspg2_gas1": 4.0, "z0_tmbspg1_gas1": 2.0, "z1_tmbspg2_gas1": 3.5}
    cands = [Candidate(s, m) for s in (0, 1) for m in (1, 2, 4, 8)]
    tried = run(model_based(cands, "throughput"), values)  # z0 mbs 8 crashes (None): skipped, not a fall
    # stage 1 from its largest size down to 2: 8 and 4 fail, 2 is worse than stage 0's best -> stop
    assert tried == [
        "z0_tmbspg8_gas1",
        "z0_tmbspg4_gas1",
        "z0_tmbspg2_gas1",
        "z0_tmbspg1_gas1",
        "z1_tmbspg8_gas1",
        "z1_tmbspg4_gas1",
        "z1_tmbspg2_gas1",
    ]


def test_model_based_descends_the_next_variant_when_one_fails_entirely():
    cands = [Candidate(s, m) for s in (0, 1) for m in (1, 2)]
    assert run(model_based(cands, "latency"), {"z1_tmbspg2_gas1": 3.0, "z1_tmbspg1_gas1": 2.0}) == [
        "z0_tmbspg2_gas1",
        "z0_tmbspg1_gas1",
        "z1_tmbspg2_gas1",
        "z1_tmbspg1_gas1",
    ]


def test_random_is_a_seeded_permutation():
    a = run(make_search("random", GRID, "throughput", early_stopping=None, seed=3), {})
    assert a == run(make_search("random", GRID, "throughput", early_stopping=None, seed=3), {})
    assert sorted(a) == sorted(c.name for c in GRID) and a != [c.name for c in GRID]
    with pytest.raises(ValueError, match="tuner_type"):
        make_search("bayes", GRID, "throughput", early_stopping=None)


def test_trial_timeout_adapts_to_the_slowest_successful_trial():
    assert trial_timeout([], 1800) == 1800
    assert trial_timeout([3.0, 10.0], 1800) == 60  # the floor
    assert trial_timeout([30.0], 1800) == 150 and trial_timeout([30.0], 100) == 100
    assert _timeout_rule(None, None) == (None, 5.0, 60.0) and _timeout_rule(None, "600") == (600.0, 5.0, 60.0)
    assert _timeout_rule(None, "2x") == (None, 2.0, 0.0) and _timeout_rule(30.0, "2x")[0] == 30.0
    with pytest.raises(AutotuningError, match="ZEROSPEED_AUTOTUNING_TRIAL_TIMEOUT='soon'"):
        _timeout_rule(None, "soon")


# -- results -------------------------------------------------------------------------------------------------
def records():
    return [
        Record(Candidate(0, 8), "ok", 2**30, {"throughput": 10.0, "latency": 800.0}, 5.0, order=0),
        Record(Candidate(0, 4), "crashed", 2**29, None, 1.0, "exit code 1: RuntimeError: boom", order=1),
        Record(Candidate(1, 8), "ok", 2**29, {"throughput": 12.0, "latency": 700.0}, 5.0, order=2),
        Record(Candidate(2, 8), "timed out", 2**29, None, 30.0, "killed after 30 s", order=3),
        Record(Candidate(0, 16), "pruned", 2**33, note="estimate 8.00 GiB > budget 4.00 GiB"),
        Record(Candidate(3, 8), "dominated", 2**28, note="z2_tmbspg8_gas1 fits it with less traffic"),
        Record(Candidate(1, 4), "not run", 2**28, note="the search stopped before it"),
    ]


def test_best_record_by_metric():
    assert best_record(records(), "throughput").candidate == Candidate(1, 8)
    assert best_record(records(), "latency").candidate == Candidate(1, 8)
    assert best_record(records()[1:2], "throughput") is None


def test_results_table_and_summary(tmp_path):
    rows = table_rows(records(), dp_size=2)
    assert [r["status"] for r in rows] == ["ok", "crashed", "ok", "timed out", "pruned", "dominated", "not run"]
    assert rows[0]["train_batch_size"] == "16" and rows[0]["estimate_mib"] == "1024.0" and rows[0]["throughput"] == "10"
    text = summary(records(), "throughput", 125.0)
    assert "| z0 | 2 | 10 | z0_tmbspg8_gas1 |" in text and "| z2 | 1 |  | (none succeeded) |" in text
    assert "| global | 4 | 12 | z1_tmbspg8_gas1 |" in text and "Tuning completed in 0:02:05" in text
    write_results(tmp_path, records(), "throughput", 125.0, 2)
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 8 and csv_lines[0].startswith("exp,stage,micro_batch")
    assert "| z0_tmbspg4_gas1 | 0 | 4 | 1 | 8 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "summary.txt").read_text() == text


def test_optimal_config_has_no_autotuning_block(tmp_path):
    path = write_optimal(
        tmp_path,
        {"train_micro_batch_size_per_gpu": 8, "autotuning": {"enabled": True}},
        ["python", "-m", "zerospeed.launcher", "t.py"],
    )
    assert json.loads(path.read_text()) == {"train_micro_batch_size_per_gpu": 8}
    assert (tmp_path / "cmd_optimal.txt").read_text() == "python -m zerospeed.launcher t.py\n"


# -- command lines ---------------------------------------------------------------------------------------------
def test_config_path_and_mapped_arguments():
    args = ["--lr", "1", "--deepspeed", "ds.json", "--per_device_train_batch_size", "4"]
    assert cmd.find_config(args) == "ds.json"
    assert cmd.find_config(["--deepspeed", "--deepspeed_config=x.json"]) == "x.json"
    with pytest.raises(ConfigError, match="--deepspeed CONFIG.json"):
        cmd.find_config(["--deepspeed"])
    assert cmd.replace_config(args, "ds.json", "/r/z1.json")[3] == "/r/z1.json"
    assert cmd.replace_config(["--deepspeed_config=ds.json"], "ds.json", "n.json") == ["--deepspeed_config=n.json"]
    maps = {
        "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
        "gradient_accumulation_steps ": "--gradient_accumulation_steps",
    }
    assert cmd.mapped_values(args, maps) == {"train_micro_batch_size_per_gpu": 4}
    out = cmd.apply_mappings(args, maps, {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2})
    assert out == [
        "--lr",
        "1",
        "--deepspeed",
        "ds.json",
        "--per_device_train_batch_size",
        "16",
        "--gradient_accumulation_steps",
        "2",
    ]


def test_launcher_flags_drop_the_autotuning_flag_and_the_user_part():
    argv = ["--autotuning", "tune", "--num_gpus", "2", "t.py", "--deepspeed", "c.json"]
    assert cmd.launcher_flags(argv, 3) == ["--num_gpus", "2"]
    assert cmd.launcher_flags(["--num_gpus=2", "--autotuning=run", "--", "t.py"], 1) == ["--num_gpus=2"]


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512 MiB") == 2**29 and parse_bytes("1e9") == 1e9
    assert parse_bytes("1.5GB") == 1.5e9


# -- the orchestration, with a fake trial runner --------------------------------------------------------------
PROFILE = {
    "num_params": 10**8,
    "largest_layer_params": 10**7,
    "param_bytes": 2,
    "grad_bytes": 2,
    "master_bytes": 4,
    "optim_bytes": 8,
    "activation_bytes": 2**28,
    "micro_batch": 1,
    "dp_world_size": 4,
    "local_size": 4,
    "device": "cuda",
    "device_memory": 3e9 / 0.9,
}


def fake_tuner(tmp_path, monkeypatch, config, outcomes):
    (tmp_path / "ds.json").write_text(json.dumps(config))
    tuner = Autotuner(["--num_gpus", "4"], UserCommand("train.py", ("--deepspeed", "ds.json")), cwd=tmp_path)
    launched = []

    def launch(name, cfg, rdir, env, out_file):
        launched.append(name)
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "ds_config.json").write_text(json.dumps(cfg))
        if name == "profile_model_info":
            return TrialResult("ok", 1.0, 0, PROFILE)
        status, value = outcomes.get(name, ("ok", 1.0))
        return TrialResult(
            status,
            2.0,
            0 if status == "ok" else 1,
            {"throughput": value} if status == "ok" else {},
            "" if status == "ok" else "exit code 1: boom",
        )

    monkeypatch.setattr(tuner, "_launch", launch)
    return tuner, launched


CONFIG = {
    "train_micro_batch_size_per_gpu": [1, 2, 4, 8],
    "zero_optimization": {"stage": "all"},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "fp16": {"enabled": True},
    "autotuning": {"enabled": True, "tuner_type": "model_based", "results_dir": "res", "exps_dir": "exps"},
}


def test_tune_prunes_searches_and_writes_the_optimal_config(tmp_path, monkeypatch):
    values = {f"z{s}_tmbspg{m}_gas1": ("ok", (1.0 + 0.01 * s) * m) for s in range(4) for m in (1, 2, 4, 8)}
    values["z0_tmbspg4_gas1"] = ("crashed", None)
    tuner, launched = fake_tuner(tmp_path, monkeypatch, CONFIG, values)
    outcome = tuner.tune()
    # budget 3e9: z0/z1 fit micro batch <= 4, z2 <= 8 (see the planner test); stage 3 dominated everywhere
    # budget 3e9: stage 0 fits micro batch <= 4, stages 1-2 <= 8; stage 3 is dominated everywhere
    assert launched == [
        "profile_model_info",
        "z0_tmbspg4_gas1",
        "z0_tmbspg2_gas1",
        "z0_tmbspg1_gas1",
        "z1_tmbspg8_gas1",
        "z1_tmbspg4_gas1",
        "z2_tmbspg8_gas1",
    ]
    status = {r.candidate.name: r.status for r in outcome.records}
    assert status["z0_tmbspg8_gas1"] == "pruned" and status["z0_tmbspg4_gas1"] == "crashed"
    assert status["z3_tmbspg4_gas1"] == "dominated"  # its twin z0 crashed, but z1_tmbspg4 ran
    assert status["z1_tmbspg1_gas1"] == "not run" and status["z3_tmbspg8_gas1"] == "dominated"
    assert outcome.best.candidate.name == "z2_tmbspg8_gas1"
    optimal = json.loads((tmp_path / "res" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"] == {"stage": 2} and optimal["train_micro_batch_size_per_gpu"] == 8
    assert "autotuning" not in optimal
    assert (tmp_path / "res" / "cmd_optimal.txt").read_text().split()[-4:] == [
        "--num_gpus",
        "4",
        "train.py",
        "--deepspeed",
        str(tmp_path / "res" / "ds_config_optimal.json"),
    ][-4:]
    for name in ("results.csv", "results.md", "summary.txt"):
        assert (tmp_path / "res" / name).exists()


def test_a_dominated_candidate_is_revived_when_its_faster_twin_fails(tmp_path, monkeypatch):
    config = dict(CONFIG, train_micro_batch_size_per_gpu=[4], zero_optimization={"stage": [0, 3]})
    tuner, launched = fake_tuner(tmp_path, monkeypatch, config, {"z0_tmbspg4_gas1": ("crashed", None)})
    outcome = tuner.tune()
    assert launched == ["profile_model_info", "z0_tmbspg4_gas1", "z3_tmbspg4_gas1"]
    assert outcome.best.candidate.name == "z3_tmbspg4_gas1"
    assert outcome.best.note == "revived: z0_tmbspg4_gas1 crashed"


def test_nothing_fits_is_an_error_naming_the_smallest(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROSPEED_AUTOTUNING_DEVICE_MEMORY", "100MiB")
    tuner, _ = fake_tuner(tmp_path, monkeypatch, CONFIG, {})
    with pytest.raises(
        AutotuningError,
        match=r"smallest, z3_tmbspg1_gas1, needs 0.62 GiB per rank, the budget "
        r"is 0.10 GiB",
    ):
        tuner.tune()


def test_exhaustive_runs_every_candidate_without_a_profile_run(tmp_path, monkeypatch):
    tuner, launched = fake_tuner(tmp_path, monkeypatch, CONFIG, {})
    tuner.exhaustive = True
    tuner.tune()
    assert len(launched) == 16 and "profile_model_info" not in launched


def test_run_trains_with_the_optimal_config(tmp_path, monkeypatch):
    import subprocess

    tuner, _ = fake_tuner(tmp_path, monkeypatch, CONFIG, {})
    tuner.tune()
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda argv, cwd: ran.append(argv) or subprocess.CompletedProcess(argv, 0))
    assert tuner.run_after_tuning() == 0
    assert ran == [(tmp_path / "res" / "cmd_optimal.txt").read_text().split()]
    assert ran[0][-1] == str(tmp_path / "res" / "ds_config_optimal.json") and "--master_port" not in " ".join(ran[0])


def test_missing_config_argument(tmp_path):
    with pytest.raises(ConfigError, match="needs the script's config"):
        Autotuner([], UserCommand("train.py", ("--lr", "1")), cwd=tmp_path)


def test_results_dir_is_relative_to_the_launch_directory(tmp_path, monkeypatch):
    tuner, _ = fake_tuner(tmp_path, monkeypatch, CONFIG, {})
    assert tuner.results_dir == Path(tmp_path) / "res" and tuner.exps_dir == Path(tmp_path) / "exps"


@pytest.mark.parametrize(
    "flags, ranks_per_node, hostfile",
    [
        ([], (1,), False),
        (["--num_gpus", "4"], (4,), False),
        (["--num_gpus=2", "--num_nodes", "3"], (2, 2, 2), False),
        (["--num_accelerators", "2", "-H", "hosts"], (2,), True),
        (["--hostfile=hosts"], (1,), True),
    ],
)
def test_trial_world_from_the_flags_alone(flags, ranks_per_node, hostfile):
    world = cmd.TrialWorld.from_flags(flags)
    assert (world.ranks_per_node, world.hostfile, world.nodes) == (ranks_per_node, hostfile, len(ranks_per_node))


def test_the_launchers_world_sets_the_dp_guess_and_the_trial_ports(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    command = UserCommand("train.py", ("--deepspeed", "ds.json"))

    def fresh_port(tuner):  # consecutive trials on this machine each get a free --master_port
        return any(a.startswith("--master_port=") for a in tuner._argv(tmp_path / "c.json", {}, trial=True))

    alone = Autotuner(["--num_gpus", "2"], command, cwd=tmp_path)
    assert alone._dp_guess() == 2 and fresh_port(alone)
    hosts = Autotuner(["--num_gpus", "2"], command, world=cmd.TrialWorld((2, 2, 1), hostfile=True), cwd=tmp_path)
    assert hosts._dp_guess() == 5 and not fresh_port(hosts)
