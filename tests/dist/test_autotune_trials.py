"""`zerospeed --autotuning tune` for real: trials through the launcher, one crashing and one hanging.

The tiny script (scripts/autotune_tiny.py) raises at micro batch 4 and sleeps forever at 2; the search
(gridsearch: largest micro batch first) meets 8 (fine), 4 (crash) and 2 (hang): both failures are
reported and skipped, the hanging trial's whole process group is killed at the time limit, and the
best config is written. (Pruning, dominated configurations and their revival are tested without
processes in tests/unit/test_autotuning.py.)
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).parent / "scripts" / "autotune_tiny.py"
# the hanging trial is killed at 2x the slowest successful one (the first trial): fast on an idle
# machine, and still longer than an ordinary trial when other jobs load it
TRIAL_TIMEOUT = "2x"


def _logs(results: Path) -> str:
    parts = []
    for log in sorted(results.glob("*/std*.log")):
        parts.append(f"--- {log.relative_to(results)}\n{log.read_text(errors='replace')[-2000:]}")
    return "\n".join(parts)


def _still_running(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or []):
                found.append(" ".join(p.info["cmdline"]))
        except psutil.Error:
            pass
    return found


@pytest.mark.timeout(150)
def test_tune_reports_and_skips_a_crashing_and_a_hanging_trial(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": [2, 4, 8],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 4,
            "model_info": {"num_params": 1732},
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    env.update(ZS_TEST_OUT=str(tmp_path), ZEROSPEED_AUTOTUNING_TRIAL_TIMEOUT=TRIAL_TIMEOUT)
    argv = [
        sys.executable,
        "-m",
        "zerospeed.launcher",
        "--autotuning",
        "tune",
        "--num_gpus",
        "1",
        str(SCRIPT),
        "--deepspeed",
        "ds.json",
        "--crash-at",
        "4",
        "--hang-at",
        "2",
    ]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=140)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the autotuner kills its running trial's process group on the way out
        out, err = proc.communicate()
    results = tmp_path / "autotuning_results"
    shown = f"rc {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}\n{_logs(results)}"
    assert proc.returncode == 0, shown

    rows = {r["exp"]: r for r in csv.DictReader((results / "results.csv").open())}
    assert {n: r["status"] for n, r in rows.items()} == {
        "z0_tmbspg8_gas1": "ok",
        "z0_tmbspg4_gas1": "crashed",
        "z0_tmbspg2_gas1": "timed out",
    }, shown
    assert "simulated out of memory at micro batch 4" in rows["z0_tmbspg4_gas1"]["note"], shown
    ok_s, hang_s = float(rows["z0_tmbspg8_gas1"]["seconds"]), float(rows["z0_tmbspg2_gas1"]["seconds"])
    assert 2 * ok_s <= hang_s < 2 * ok_s + 10, shown  # killed at its limit, group and all, within the grace
    assert float(rows["z0_tmbspg8_gas1"]["throughput"]) > 0, shown
    metrics = json.loads((results / "z0_tmbspg8_gas1" / "metrics.json").read_text())
    assert metrics["steps"] == [2, 4] and len(metrics["step_seconds"]) == 3

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal == {
        "optimizer": config["optimizer"],
        "zero_optimization": {"stage": 0},
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
    }
    cmd = (results / "cmd_optimal.txt").read_text().split()
    assert cmd[-6:] == ["--deepspeed", str(results / "ds_config_optimal.json"), "--crash-at", "4", "--hang-at", "2"]
    assert "| global | 3 |" in (results / "summary.txt").read_text()
    assert (tmp_path / "autotuning_exps" / "z0_tmbspg2_gas1.json").exists()

    # the hanging trial and its launcher are gone: nothing of this test's trials is left running
    assert (
        not psutil.pid_exists(int((tmp_path / "hang_pid").read_text()))
        or psutil.Process(int((tmp_path / "hang_pid").read_text())).status() == psutil.STATUS_ZOMBIE
    )
    assert not _still_running(str(results)), _still_running(str(results))
