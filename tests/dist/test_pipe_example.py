"""The pipeline example trains the small GPT as 2 stages through the launcher."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
def test_pipeline_example_through_the_launcher(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "zerospeed.launcher",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples" / "train_gpt_pipe.py"),
        "--deepspeed",
        str(ROOT / "examples/configs/gpt_pipe.json"),
        "--steps",
        "12",
        "--seq-len",
        "32",
        "--corpus-bytes",
        "200000",
        "--out-dir",
        str(tmp_path),
    ]
    run = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=140,
        env={**os.environ, "ZEROSPEED_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"] == 2 and summary["world_size"] == 2 and summary["steps"] == 12
    assert [r["stage"] for r in summary["per_rank"]] == [0, 1]
    # type:PipeBlock puts 2 of the 4 blocks on each stage; the embedding starts stage 0, the head ends stage 1
    assert [r["layers"] for r in summary["per_rank"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert summary["final_loss"] < summary["first_loss"] - 0.5
