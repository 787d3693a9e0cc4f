"""Launcher test helper: write this rank's argv and launch environment to <ZS_TEST_OUT>/rank<RANK>.json."""

import json
import os
import sys

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ZEROSPEED_RANK_SPEC",
]  # torch's agent's, ours
with open(os.path.join(os.environ["ZS_TEST_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(
        {"argv": sys.argv, "env": {k: os.environ.get(k) for k in KEYS}, "affinity": sorted(os.sched_getaffinity(0))}, f
    )
