"""Records what the real DeepSpeed 0.19.8 writes and samples for tests/unit/test_data_sampling.py (run with the
DeepSpeed venv: `/work/dsvenv/bin/python tests/dist/scripts/ds_curriculum_record.py OUT.json`).

Its DataAnalyzer analyzes the 20-sample dataset of the test (one `seqlen` value per sample and a
per-value histogram summed over batches); the sha256 of each file it writes is recorded. Then its
DeepSpeedDataSampler runs the test's curricula on those files (one process, gloo) and the first
micro-batches it hands out are recorded.
"""

import hashlib
import json
import os
import sys
import tempfile

import torch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29731")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed.comm as dist  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler  # noqa: E402

VALUES = [(i * 7) % 5 + 1 for i in range(20)]  # the test's dataset: seqlen of sample i
FILES = [
    "seqlen/seqlen_sample_to_metric",
    "seqlen/seqlen_index_to_metric",
    "seqlen/seqlen_index_to_sample",
    "seqlen/seqlen_index_to_sample_percentile_merged",
    "hist/hist_metric_value",
]


def config(save, clusters, kind):
    metric = {
        "index_to_sample_path": f"{save}/seqlen/seqlen_index_to_sample",
        "index_to_metric_path": f"{save}/seqlen/seqlen_index_to_metric",
        "difficulty_type": kind,
        "clustering_type": "schedule_based",
        "min_difficulty": 2 if kind == "value" else 3,
        "max_difficulty": 5 if kind == "value" else 10,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [2, 4, 5] if kind == "value" else [3, 6, 10], "max_step": [2, 4]},
    }
    if kind == "percentile":
        metric["index_to_sample_path"] = f"{save}/seqlen/seqlen_index_to_sample_percentile_merged"
    return {
        "enabled": True,
        "seed": 1234,
        "data_sampling": {
            "enabled": True,
            "num_epochs": 10,
            "num_workers": 0,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": clusters,
                "curriculum_metrics": {"seqlen": metric},
            },
        },
        "data_routing": {},
    }


def main(out):
    dist.init_distributed(dist_backend="gloo")
    save = tempfile.mkdtemp()
    data = [torch.tensor(v) for v in VALUES]
    analyzer = DataAnalyzer(
        data,
        batch_size=3,
        metric_names=["seqlen", "hist"],
        metric_functions=[lambda b: b.to(torch.int64), lambda b: torch.bincount(b, minlength=6)],
        metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
        metric_dtypes=[torch.int64, torch.int64],
        save_path=save,
    )
    analyzer.run_map_reduce()
    record = {"files": {}}
    for name in FILES:
        for ext in (".bin", ".idx"):
            with open(f"{save}/{name}{ext}", "rb") as f:
                record["files"][name + ext] = hashlib.sha256(f.read()).hexdigest()
    for kind in ("value", "percentile"):
        sampler = DeepSpeedDataSampler(
            config(save, tempfile.mkdtemp(), kind), len(VALUES), 2, 0, 1, dist.get_world_group(), 2, 0
        )
        batches, it = [], iter(sampler)
        for _ in range(16):
            batches.append([int(i) for i in next(it)])
        record[kind] = batches
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
