"""The demo trains as one job across two launcher invocations ("nodes") on this machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_demo_trains_across_two_launched_nodes(tmp_path):
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "zerospeed.launcher",
            "--num_nodes",
            "2",
            "--node_rank",
            str(node),
            "--num_gpus",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            str(ROOT / "examples" / "train_gpt.py"),
            "--deepspeed",
            str(ROOT / "examples/configs/gpt_zero0.json"),
            "--steps",
            "4",
            "--model-size",
            "tiny",
            "--seq-len",
            "32",
            "--corpus-bytes",
            "200000",
            "--out-dir",
            str(tmp_path / f"node{node}"),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "ZEROSPEED_ACCELERATOR": "cpu"},
            )
        )
    outs = [p.communicate(timeout=170)[0] for p in procs]
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-3000:]}"
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert (tmp_path / "node0" / "loss.png").stat().st_size > 0
