"""Curriculum data sampling: the offline analyzer's files and the sampler's order on a 20-sample dataset,
against the difficulty schedule computed by hand and against what DeepSpeed 0.19.8 wrote and sampled
(tests/fixtures/ds_curriculum_sampler.json, recorded by tests/dist/scripts/ds_curriculum_record.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import zerospeed
from zerospeed.data.analyzer import DataAnalyzer
from zerospeed.data.indexed import IndexedFile, fit_int_dtype, write_indexed
from zerospeed.data.sampler import DeepSpeedDataSampler
from zerospeed.utils.errors import ConfigError

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "ds_curriculum_sampler.json").read_text())
VALUES = [(i * 7) % 5 + 1 for i in range(20)]  # sample i's "seqlen": 1 3 5 2 4 1 3 5 2 4 ...
BY_VALUE = {v: [i for i, x in enumerate(VALUES) if x == v] for v in range(1, 6)}  # by hand: i % 5 decides


def analyze(save: Path, workers: int = 1) -> None:
    data = [torch.tensor(v) for v in VALUES]
    for w in range(workers):
        DataAnalyzer(
            data,
            num_workers=workers,
            worker_id=w,
            batch_size=3,
            metric_names=["seqlen", "hist"],
            metric_functions=[lambda b: b.to(torch.int64), lambda b: torch.bincount(b, minlength=6)],
            metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
            metric_dtypes=[torch.int64, torch.int64],
            save_path=str(save),
        ).run_map()
    DataAnalyzer(
        data,
        num_workers=workers,
        metric_names=["seqlen", "hist"],
        metric_functions=[None, None],
        metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
        metric_dtypes=[torch.int64, torch.int64],
        save_path=str(save),
    ).run_reduce()


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("analyzed")
    analyze(save)
    return save


def curriculum(save: Path, clusters: Path, kind: str) -> dict:
    metric = {
        "index_to_sample_path": str(save / "seqlen" / "seqlen_index_to_sample"),
        "index_to_metric_path": str(save / "seqlen" / "seqlen_index_to_metric"),
        "difficulty_type": kind,
        "clustering_type": "schedule_based",
        "min_difficulty": 2 if kind == "value" else 3,
        "max_difficulty": 5 if kind == "value" else 10,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [2, 4, 5] if kind == "value" else [3, 6, 10], "max_step": [2, 4]},
    }
    if kind == "percentile":
        metric["index_to_sample_path"] = str(save / "seqlen" / "seqlen_index_to_sample_percentile_merged")
    return {
        "seed": 1234,
        "data_sampling": {
            "num_epochs": 10,
            "num_workers": 0,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": str(clusters),
                "curriculum_metrics": {"seqlen": metric},
            },
        },
    }


def sampler(save: Path, clusters: Path, kind: str) -> DeepSpeedDataSampler:
    # 20 samples, micro batch 2, 1 rank, 2 accumulation steps: a global batch of 4 = 2 micro-batches per step
    return DeepSpeedDataSampler(curriculum(save, clusters, kind), len(VALUES), 2, 0, 1, None, 2, 0)


def test_indexed_files_round_trip_and_dtypes(tmp_path):
    items = [np.array([3, 1, 2]), np.array([], dtype=np.int64), np.array([7])]
    write_indexed(tmp_path / "f", items, np.uint16)
    f = IndexedFile(tmp_path / "f")
    assert len(f) == 3 and f.dtype == np.uint16 and [list(x) for x in f[:]] == [[3, 1, 2], [], [7]]
    assert (tmp_path / "f.bin").stat().st_size == 4 * 2
    assert list(f.doc_idx) == [0, 3]
    assert [fit_int_dtype(0, 255), fit_int_dtype(0, 256), fit_int_dtype(-1, 127), fit_int_dtype(-1, 128)] == [
        np.uint8,
        np.uint16,
        np.int8,
        np.int16,
    ]


@pytest.mark.parametrize("workers", [1, 3])
def test_analyzer_writes_deepspeeds_files_byte_for_byte(tmp_path, workers):
    analyze(tmp_path, workers)
    for name, digest in FIXTURE["files"].items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest, name
    # and what they hold, by hand: the values ascending, each with its samples in dataset order
    index_to_metric = IndexedFile(tmp_path / "seqlen" / "seqlen_index_to_metric")
    index_to_sample = IndexedFile(tmp_path / "seqlen" / "seqlen_index_to_sample")
    assert [int(x[0]) for x in index_to_metric[:]] == [1, 2, 3, 4, 5]
    assert [list(map(int, x)) for x in index_to_sample[:]] == [BY_VALUE[v] for v in range(1, 6)]
    assert list(IndexedFile(tmp_path / "hist" / "hist_metric_value")[0]) == [0, 4, 4, 4, 4, 4]


def admitted(kind: str, difficulty: int) -> set[int]:
    """By hand: the samples a difficulty admits (value: seqlen <= d; percentile: the first 2 * d samples
    sorted by value, 20 // 10 = 2 per percent-decile)."""
    if kind == "value":
        return {i for i, v in enumerate(VALUES) if v <= difficulty}
    ordered = [i for v in range(1, 6) for i in BY_VALUE[v]]
    return set(ordered[: 2 * difficulty])


@pytest.mark.parametrize("kind", ["value", "percentile"])
def test_sampler_order_follows_the_difficulty_schedule(analyzed, tmp_path, kind):
    it = iter(sampler(analyzed, tmp_path, kind))
    micro = [next(it) for _ in range(16)]
    # fixed_discrete: difficulty[0] for steps 1-2, difficulty[1] for steps 3-4, then the last; 2 micro-batches a step
    schedule = [2, 4, 5] if kind == "value" else [3, 6, 10]
    for k, batch in enumerate(micro):
        step = k // 2 + 1
        difficulty = schedule[0] if step <= 2 else schedule[1] if step <= 4 else schedule[2]
        assert len(batch) == 2 and set(batch) <= admitted(kind, difficulty), (step, batch)
    first = [i for b in micro[:4] for i in b]  # the first cluster, read in its shuffled order: no repeats
    assert len(set(first)) == len(first) == 8 if kind == "value" else len(first) == 8
    assert micro == FIXTURE[kind]  # DeepSpeed 0.19.8's own order for the same files and seed
    clusters = sorted(p.name for p in tmp_path.glob("*.idx"))
    expected = [f"cluster_seqlen{d}.idx" for d in schedule]
    assert clusters == sorted(expected)
    assert set(IndexedFile(tmp_path / f"cluster_seqlen{schedule[0]}")[0].tolist()) == admitted(kind, schedule[0])


def test_sampler_state_resumes_exactly(analyzed, tmp_path):
    a = sampler(analyzed, tmp_path / "a", "value")
    it = iter(a)
    head = [next(it) for _ in range(5)]
    state = a.state_dict()
    tail = [next(it) for _ in range(7)]
    b = sampler(analyzed, tmp_path / "a", "value")
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [next(iter(b)) for _ in range(1)] + [x for _, x in zip(range(6), iter(b))] == tail
    assert head == FIXTURE["value"][:5]


def test_missing_analysis_is_an_error_naming_the_key(tmp_path):
    cfg = curriculum(tmp_path / "nothing", tmp_path, "value")
    with pytest.raises(ConfigError, match="curriculum_metrics.seqlen.index_to_sample_path=.*run the data analyzer"):
        DeepSpeedDataSampler(cfg, 20, 2, 0, 1, None, 2, 0)


def test_initialize_trains_on_the_curriculum_batches(analyzed, tmp_path):
    # the engine's training loader is the curriculum loader: its micro-batches are the sampler's, in order
    data = [(torch.tensor([float(v)]), torch.tensor([float(i)])) for i, v in enumerate(VALUES)]
    model = torch.nn.Linear(1, 1)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "data_efficiency": {"enabled": True, **curriculum(analyzed, tmp_path / "engine", "value")},
    }
    cfg["data_efficiency"]["data_sampling"]["enabled"] = True
    engine, _, loader, _ = zerospeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, training_data=data
    )
    got = [next(loader)[1].reshape(-1).long().tolist() for _ in range(6)]
    assert got == FIXTURE["value"][:6]
    # (as in DeepSpeed, a micro-batch counts as consumed once the next one is asked for)
    assert engine.curriculum_learning_enabled() and loader.state_dict()["consumed_samples"] == 10
