"""The DeepSpeed tutorial configs users copy (ZeRO-2 + CPU optimizer offload with "auto" values,
ZeRO-3 + CPU offload of parameters and optimizer) train the demo model unchanged, launched as users do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "configs"
TUTORIAL = {
    "tutorial_zero2_cpu_offload_auto.json": "zero2_cpu_offload_auto.json",
    "tutorial_zero3_cpu_offload.json": "zero3_cpu_offload.json",
}


@pytest.mark.parametrize("ours,theirs", sorted(TUTORIAL.items()))
def test_example_copies_are_the_tutorial_files_unchanged(ours, theirs):
    if not (SHARED / theirs).is_file():
        pytest.skip(f"{SHARED / theirs} not available")
    assert (ROOT / "examples" / "configs" / ours).read_bytes() == (SHARED / theirs).read_bytes()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config", sorted(TUTORIAL))
def test_tutorial_config_trains_the_demo_model(config, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "zerospeed.launcher",
        "--num_gpus",
        "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--deepspeed",
        str(ROOT / "examples" / "configs" / config),
        "--steps",
        "12",
        "--model-size",
        "tiny",
        "--seq-len",
        "32",
        "--corpus-bytes",
        "200000",
        "--out-dir",
        str(tmp_path),
    ]
    out = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=190,
        env={**os.environ, "ZEROSPEED_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["zero_stage"] == (2 if "zero2" in config else 3)
    assert summary["final_loss"] < summary["first_loss"] - 0.3
