"""Run one trial: the launcher in a session of its own, a time limit, the whole process tree killed
when it is hit, and a `TrialResult` that says what happened.

Note [trial isolation]: every trial is ``python -m zerospeed.launcher ...`` started with
``start_new_session=True``, so the launcher and every rank it starts share one process group that
belongs to nothing else. A trial past its time limit gets SIGTERM on that group (the launcher stops
its ranks), then SIGKILL on the group and on every process still descending from it, so a hanging
rank can neither block the search (DeepSpeed's autotuner waits forever, deepspeed#4100) nor outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

OK, CRASHED, TIMED_OUT, NO_METRIC = "ok", "crashed", "timed out", "no metric"
TERM_GRACE_S = 5.0


@dataclass
class TrialResult:
    """How one trial ended and what it measured."""

    status: str
    seconds: float
    returncode: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])[:300]


def kill_tree(proc: subprocess.Popen) -> None:
    """Note [trial isolation]: SIGTERM the trial's process group, then SIGKILL what is left of it."""
    try:
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        family = [proc.pid]
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    for pid in family:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_trial(
    argv: list[str],
    result_dir: Path,
    *,
    env: dict[str, str],
    timeout: float,
    metric_file: Path | None,
    cwd: str | None = None,
) -> TrialResult:
    """Run ``argv`` with stdout / stderr in ``result_dir``; read ``metric_file`` when it exits 0."""
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "cmd.txt").write_text(" ".join(argv) + "\n")
    if metric_file is not None and metric_file.exists():
        metric_file.unlink()
    start = time.monotonic()
    with open(result_dir / "stdout.log", "wb") as out, open(result_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return TrialResult(
                TIMED_OUT,
                time.monotonic() - start,
                None,
                note=f"killed after {timeout:.0f} s (the whole process group)",
            )
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C, SIGTERM): leave nothing behind
                kill_tree(proc)
    seconds = time.monotonic() - start
    if rc != 0:
        return TrialResult(CRASHED, seconds, rc, note=f"exit code {rc}: {_tail(result_dir / 'stderr.log')}")
    if metric_file is None:
        return TrialResult(OK, seconds, rc)
    try:
        metrics = json.loads(metric_file.read_text())
    except (OSError, json.JSONDecodeError):
        return TrialResult(
            NO_METRIC,
            seconds,
            rc,
            note=f"exit code 0 but no {metric_file.name}: did the script stop "
            "before end_profile_step, or not use zerospeed.initialize?",
        )
    return TrialResult(OK, seconds, rc, metrics)


def trial_timeout(ok_seconds: list[float], base: float, *, factor: float = 5.0, floor: float = 60.0) -> float:
    """The time limit of the next trial: ``base`` until one trial succeeded, then ``factor`` x the
    slowest successful trial (at least ``floor`` s, at most ``base``)."""
    if not ok_seconds:
        return base
    return min(base, max(floor, factor * max(ok_seconds)))
