"""Elastic training through the ``zerospeed`` command: 2 ranks, a node dies -> 1 rank, a node joins -> 2.

Each "node" is one ``zerospeed`` launcher with one rank on loopback, started as docs/elasticity.md
tells users to start one per machine:

    zerospeed --elastic_training --min_elastic_nodes 1 --max_elastic_nodes 2 --num_nodes 2 \\
        --node_rank R --master_addr 127.0.0.1 --master_port PORT --num_gpus 1 elastic_train.py --out DIR

(R = 0 for node A, which hosts the rendezvous; 1 for B and for C, the machine that replaces it).
The script (``scripts/elastic_train.py``) saves a checkpoint every step and on start loads
``latest``; the ``elasticity`` block gives it the same global batch (8) at 1 and 2 ranks by
changing the accumulation steps (4 and 2). The test

1. starts A and B; both ranks train steps 1-2;
2. kills B's launcher and rank with SIGKILL (a lost machine): A's rank fails in its next collective,
   A's agent restarts it in a new rendezvous round without B, and it resumes from step 2 at world
   size 1 (the checkpoint reshards from 2 ranks to 1) and trains steps 3-4;
3. starts C: A's agent sees the waiting node and restarts its rank; A's and C's ranks resume from
   step 4 at world size 2 and train steps 5-6; both launchers exit 0, and no process is left.

Ranks wait at a gate file before each step, so the membership changes happen between steps, where
the test puts them. Every step's loss (the mean over the global batch, before the update) must equal
that of one plain PyTorch process training on the same global batches (fp32, <= 1e-5) -- which is what
sequential runs at world sizes 2, 1, 2 resuming from checkpoints give, as each step is the same global
step at any world size. Launcher and rank output is shown when anything fails or times out.

The ranks are new interpreters (importing torch and zerospeed: about 4 s each at light load, up to
20 s at a load average of 10), three generations of them; the test waits for nothing else that long.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import free_port

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
_spec = importlib.util.spec_from_file_location("elastic_train", SCRIPT)
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def _zerospeed() -> list[str]:
    """The ``zerospeed`` command of this interpreter's environment (its module when not installed)."""
    script = Path(sys.executable).with_name("zerospeed")
    return [str(script)] if script.exists() else [sys.executable, "-m", "zerospeed.launcher"]


# A node silent for 3 heartbeats of 1 s is dropped; once one node is in, the round waits 2 s for more.
RDZV_ENV = {
    "ZEROSPEED_RDZV_TIMEOUT": "60",
    "ZEROSPEED_RDZV_KEEP_ALIVE_INTERVAL": "1",
    "ZEROSPEED_RDZV_LAST_CALL_TIMEOUT": "2",
}


class Job:
    """The node launchers of one elastic job, their output, and the log rank 0 writes."""

    def __init__(self, out: Path):
        self.out, self.port, self.launchers = out, free_port(), {}
        self.log = out / "log.jsonl"

    def command(self, node_rank: int) -> list[str]:
        return [
            *_zerospeed(),
            "--elastic_training",
            "--min_elastic_nodes",
            "1",
            "--max_elastic_nodes",
            "2",
            "--num_nodes",
            "2",
            "--node_rank",
            str(node_rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(self.port),
            "--num_gpus",
            "1",
            str(SCRIPT),
            "--out",
            str(self.out),
        ]

    def start(self, node: str, node_rank: int) -> None:
        env = {
            **os.environ,
            "ELASTIC_NODE": node,
            "ZS_TEST_JOB": str(self.out),
            "ZEROSPEED_ACCELERATOR": "cpu",
            "LOGLEVEL": "INFO",  # torch's agent logs its rendezvous rounds (shown when the test fails)
            "OMP_NUM_THREADS": "1",  # two "machines" on one machine's 2 cores
            **RDZV_ENV,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        }
        log = open(self.out / f"launcher.{node}.log", "w")
        self.launchers[node] = subprocess.Popen(
            self.command(node_rank), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def rank_pids(self, node: str) -> list[int]:
        return [int(p.name.split(".")[2]) for p in self.out.glob(f"pid.{node}.*")]

    def kill_node(self, node: str) -> None:
        """SIGKILL the launcher and then its rank (they run in their own sessions): a lost machine."""
        os.killpg(self.launchers[node].pid, signal.SIGKILL)
        self.launchers[node].wait()
        for pid in self.rank_pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def open_gates(self, *steps: int) -> None:
        for step in steps:
            (self.out / f"go{step}").touch()

    def wait(self, what: str, found, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not found(self.events()):
            failed = {n: p.returncode for n, p in self.launchers.items() if p.poll() not in (None, 0, -9)}
            if failed or time.monotonic() > deadline:
                raise AssertionError(
                    f"waiting for {what}: "
                    + ("launchers failed " + str(failed) if failed else f"timed out after {timeout:g} s")
                    + "\n"
                    + self.report()
                )
            time.sleep(0.05)

    def report(self) -> str:
        parts = [f"--- rank 0's log\n{self.log.read_text() if self.log.exists() else '(none)'}"]
        for node, proc in self.launchers.items():
            text = (self.out / f"launcher.{node}.log").read_text()
            parts.append(f"--- launcher {node} (exit {proc.poll()}), last 6000 chars\n{text[-6000:]}")
        return "\n".join(parts)

    def processes(self) -> list[psutil.Process]:
        """Live processes of the job: the launchers and their ranks carry ZS_TEST_JOB in their environment."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("ZS_TEST_JOB") == str(self.out) and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def cleanup(self) -> list[str]:
        """Kill whatever of the job is left; describe what was still alive (orphans)."""
        for proc in self.launchers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + 3  # a rank whose launcher just died gets SIGTERM (PR_SET_PDEATHSIG)
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = []
        for proc in left:
            try:
                alive.append(f"{proc.pid} {proc.cmdline()}")
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        return alive


def _saved(events, step: int, world: int) -> bool:
    return any(e["event"] == "saved" and e["step"] == step and e["world"] == world for e in events)


def _started(events, world: int, at_step: int) -> bool:
    return any(e["event"] == "start" and e["world"] == world and e["step"] == at_step for e in events)


@pytest.mark.timeout(300)  # every wait below is bounded too, and a failure shows the launchers' output
def test_shrink_and_grow_through_the_cli_resume_from_checkpoints_with_a_fixed_global_batch(tmp_path):
    start = time.monotonic()
    job = Job(tmp_path)
    marks = {}
    try:
        job.start("A", node_rank=0)
        job.start("B", node_rank=1)
        job.wait("both ranks to start", lambda ev: _started(ev, world=2, at_step=0), 60)
        marks["2 ranks up"] = time.monotonic() - start
        job.open_gates(1, 2)
        job.wait("step 2 saved at world size 2", lambda ev: _saved(ev, 2, world=2), 20)
        job.kill_node("B")
        marks["B killed"] = time.monotonic() - start
        job.open_gates(3, 4)
        job.wait("step 4 saved at world size 1", lambda ev: _saved(ev, 4, world=1), 60)
        marks["1 rank done"] = time.monotonic() - start
        job.start("C", node_rank=1)
        job.wait("two ranks resuming at step 4", lambda ev: _started(ev, world=2, at_step=4), 60)
        marks["2 ranks up again"] = time.monotonic() - start
        job.open_gates(5, 6)
        job.wait("step 6 saved", lambda ev: _saved(ev, 6, world=2), 20)
        marks["step 6 saved"] = time.monotonic() - start
        for node in ("A", "C"):
            try:
                code = job.launchers[node].wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"launcher {node} did not exit\n{job.report()}") from None
            assert code == 0, f"launcher {node} exited {code}\n{job.report()}"
            marks[f"{node} exited"] = time.monotonic() - start
    finally:
        orphans = job.cleanup()
    assert not orphans, f"processes left running: {orphans}\n{job.report()}"

    events = job.events()
    steps = [e for e in events if e["event"] == "step"]
    worlds = {e["step"]: e["world"] for e in steps}
    assert worlds == {1: 2, 2: 2, 3: 1, 4: 1, 5: 2, 6: 2}, job.report()
    # the global batch is fixed; the accumulation steps make it up at each world size
    assert {(e["world"], e["micro"], e["gas"], e["train_batch"]) for e in events} == {(2, 2, 2, 8), (1, 2, 4, 8)}
    starts = [e for e in events if e["event"] == "start"]
    assert [e["step"] for e in starts][-2:] == [2, 4]  # resumed from the checkpoints
    # the lost node cost A's launcher one of its --max_restarts; the joining one none (C's own count is 0)
    shrink, grow = starts[-2:]
    assert (shrink["restarts"], grow["restarts"]) == (1, 1 if grow["node"] == "A" else 0), starts
    losses = {}
    for e in steps:  # a step logged twice (killed before its save) must give the same loss both times
        assert losses.setdefault(e["step"], e["loss"]) == pytest.approx(e["loss"], abs=1e-6)
    reference = train.reference_losses()
    got = [losses[s] for s in range(1, train.STEPS + 1)]
    assert max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (got, reference)
    print(f"elastic 2 -> 1 -> 2 ranks through zerospeed: {marks}; losses {got}")
