"""Curriculum data sampling on 2 data-parallel ranks: the leader draws each global batch and broadcasts it,
each rank takes its share; together the ranks' micro-batches are DeepSpeed 0.19.8's one-rank order for the
same global batch size and files (tests/fixtures/ds_curriculum_sampler.json; the dataset and curriculum
are tests/unit/test_data_sampling.py's value-based ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.data.analyzer import DataAnalyzer
from zerospeed.data.sampler import DeepSpeedDataSampler

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "ds_curriculum_sampler.json").read_text())
VALUES = [(i * 7) % 5 + 1 for i in range(20)]


def curriculum(save: str, clusters: str) -> dict:
    metric = {
        "index_to_sample_path": f"{save}/seqlen/seqlen_index_to_sample",
        "index_to_metric_path": f"{save}/seqlen/seqlen_index_to_metric",
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 2,
        "max_difficulty": 5,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [2, 4, 5], "max_step": [2, 4]},
    }
    learning = {"enabled": True, "data_cluster_path": clusters, "curriculum_metrics": {"seqlen": metric}}
    return {"seed": 1234, "data_sampling": {"num_epochs": 10, "curriculum_learning": learning}}


def shares(save: str, clusters: str) -> list[list[int]]:
    # micro batch 1 x 2 ranks x 2 accumulation steps: the recorded run's global batch of 4
    sampler = DeepSpeedDataSampler(curriculum(save, clusters), 20, 1, comm.get_rank(), 2, None, 2, comm.get_rank())
    it = iter(sampler)
    return [next(it) for _ in range(16)]


@pytest.mark.timeout(60)
def test_two_ranks_split_deepspeeds_global_batches(tmp_path):
    DataAnalyzer(
        [torch.tensor(v) for v in VALUES],
        batch_size=3,
        metric_names=["seqlen"],
        metric_functions=[lambda b: b.to(torch.int64)],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[torch.int64],
        save_path=str(tmp_path / "analysis"),
    ).run_map_reduce()
    per_rank = run_distributed(shares, 2, str(tmp_path / "analysis"), str(tmp_path / "clusters"))
    assert [len(b) for b in per_rank[0]] == [1] * 16
    assert [a + b for a, b in zip(*per_rank)] == FIXTURE["value"]
    clusters = sorted(p.name for p in (tmp_path / "clusters").glob("*.idx"))
    assert clusters == ["cluster_seqlen2.idx", "cluster_seqlen4.idx", "cluster_seqlen5.idx"]
