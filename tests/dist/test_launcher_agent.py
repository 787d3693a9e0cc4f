"""The launcher on torch's elastic agent, with faults: a node killed mid-step, a node that never
arrives, restarts. Each fault's time bound is measured here and printed (pytest -s shows it)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import free_port

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = [sys.executable, "-m", "zerospeed.launcher"]
KILL_TO_EXIT_S = 10  # the bound: a lost node ends the whole job within this
RDZV_TIMEOUT_S = 3  # ZEROSPEED_RDZV_TIMEOUT of the never-arriving-node test


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    env.update(ZS_TEST_OUT=str(out), **extra)
    return env


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([*LAUNCH, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _job_processes(out: Path) -> list[psutil.Process]:
    """Live processes of the job: every launcher, node launcher and rank has ZS_TEST_OUT or ZS_TEST_JOB=out."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if str(out) in (env.get("ZS_TEST_OUT"), env.get("ZS_TEST_JOB")) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _assert_no_orphans(out: Path, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _job_processes(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running after the job ended: {[(p.pid, p.cmdline()) for p in left]}"


def _wait_for_steps(
    out: Path, ranks: list[int], procs: list[subprocess.Popen], steps: int = 3, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = [out / f"step{r}" for r in ranks]
        if all(p.exists() and int(p.read_text() or 0) >= steps for p in done):
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a launcher ended before step {steps} (code {p.returncode}):\n{p.communicate()}")
        assert time.monotonic() < deadline, f"ranks never reached step {steps}"
        time.sleep(0.05)


def _kill_and_time(victim: int, launcher: subprocess.Popen) -> tuple[float, str, str]:
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    out, err = launcher.communicate(timeout=30)
    return time.monotonic() - start, out, err


@pytest.mark.timeout(90)
def test_killed_node_ends_the_job_naming_the_node_and_its_ranks(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    job = _popen(
        [
            "--hostfile",
            str(hostfile),
            "--launcher",
            "local",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "launcher_steps.py"),
        ],
        _env(tmp_path),
    )
    try:
        _wait_for_steps(tmp_path, [0, 1], [job])
        node1 = next(c for c in psutil.Process(job.pid).children() if "--node_rank=1" in c.cmdline())
        elapsed, _, err = _kill_and_time(node1.pid, job)
    finally:
        job.kill()
    print(f"\nkilled node launcher -> job exit: {elapsed:.2f} s")
    assert job.returncode != 0, err
    assert elapsed < KILL_TO_EXIT_S, err
    assert re.search(
        rf"^zerospeed: node 1 on 127\.0\.0\.1 \(rank 1\) \(pid {node1.pid}\) was killed by signal "
        r"SIGKILL; stopped the other 1 process\(es\)$",
        err,
        re.MULTILINE,
    ), err
    _assert_no_orphans(tmp_path)


@pytest.mark.timeout(90)
def test_node_killed_without_a_supervisor_takes_its_ranks_and_the_job_down(tmp_path):
    # torchrun style: one `zerospeed --node_rank R` per node, nothing above them. Node 1's rank must
    # die with its launcher (Note [ranks die with their node launcher]); node 0's rank then loses
    # its peer mid-all-reduce, and node 0's agent ends node 0 with that rank's traceback.
    # Node 1 starts first: torch's rendezvous alone would rank it first (Note [node order]).
    port, outs = str(free_port()), [tmp_path / "node0", tmp_path / "node1"]
    nodes = {}
    for r in (1, 0):
        outs[r].mkdir()
        nodes[r] = _popen(
            [
                "--num_nodes",
                "2",
                "--node_rank",
                str(r),
                "--num_gpus",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                str(SCRIPTS / "launcher_steps.py"),
            ],
            _env(outs[r], ZS_TEST_JOB=str(tmp_path)),
        )
        time.sleep(0.3)
    nodes = [nodes[0], nodes[1]]
    try:
        for r in range(2):
            _wait_for_steps(outs[r], [r], nodes)  # --node_rank 0 runs rank 0, --node_rank 1 rank 1
        rank1 = int((outs[1] / "pid1").read_text())
        elapsed, _, err = _kill_and_time(nodes[1].pid, nodes[0])
    finally:
        for n in nodes:
            n.kill()
    print(f"\nkilled node 1 launcher -> node 0 exit: {elapsed:.2f} s")
    # The rank raises "Connection closed by peer" and exits 1 — or, when gloo's transport thread is still
    # running as the interpreter tears down, C++ calls std::terminate and the rank dies of SIGABRT (seen
    # in one clean-clone CI run here, 2026-12-04); either way node 0 ends at once with its traceback.
    assert nodes[0].returncode in (1, 128 + signal.SIGABRT), err
    assert elapsed < KILL_TO_EXIT_S, err
    assert re.search(
        r"^zerospeed: rank 0 \(pid \d+\) (exited with code 1|was killed by signal SIGABRT); "
        r"stopped the other 0 process\(es\)$",
        err,
        re.MULTILINE,
    ), err
    assert "zerospeed: rank 0's traceback:" in err and "Traceback (most recent call last):" in err, err
    assert not psutil.pid_exists(rank1) or psutil.Process(rank1).status() == psutil.STATUS_ZOMBIE
    _assert_no_orphans(tmp_path)
    assert not (outs[0] / "step1").exists() and not (outs[1] / "step0").exists()


@pytest.mark.timeout(90)
def test_node_that_never_arrives_is_named_by_the_rendezvous_timeout(tmp_path, capfd):
    # Two jobs of two nodes, each started with one node only: node 0 alone waits for node 1, which
    # never comes; node 1 alone cannot reach the store that node 0 would host. Launched from this
    # process (torch imported already), so the time measured is the rendezvous's.
    from test_launcher_procs import _run_here

    env = _env(tmp_path, ZEROSPEED_RDZV_TIMEOUT=str(RDZV_TIMEOUT_S))
    results, ends = [], []
    for r in range(2):
        port = free_port()
        start = time.monotonic()
        results.append(
            (
                port,
                _run_here(
                    [
                        "--num_nodes",
                        "2",
                        "--node_rank",
                        str(r),
                        "--num_gpus",
                        "1",
                        "--master_addr",
                        "127.0.0.1",
                        "--master_port",
                        str(port),
                        str(SCRIPTS / "launcher_dump.py"),
                    ],
                    env,
                    capfd,
                ),
            )
        )
        ends.append(time.monotonic() - start)
    print(
        f"\nrendezvous timeout {RDZV_TIMEOUT_S} s -> node 0 alone exits after {ends[0]:.2f} s, "
        f"node 1 alone after {ends[1]:.2f} s"
    )
    (port0, alone0), (port1, alone1) = results
    assert (alone0.returncode, alone1.returncode) == (1, 1), (alone0.stderr, alone1.stderr)
    assert (
        f"zerospeed: error: node 0: the rendezvous at 127.0.0.1:{port0} timed out after {RDZV_TIMEOUT_S} s: "
        "node(s) 1 of 2 never arrived; start the missing node launchers"
    ) in alone0.stderr, alone0.stderr
    assert (
        f"zerospeed: error: node 1: cannot reach the rendezvous store at 127.0.0.1:{port1}, which node 0 "
        f"hosts, within {RDZV_TIMEOUT_S} s: node 0 never arrived"
    ) in alone1.stderr, alone1.stderr
    for end in ends:
        # ends at the timeout, not at torch's 600 s default; the slack is teardown on a loaded machine
        # (a CI run took 8.04 s with the suite's other processes around it)
        assert RDZV_TIMEOUT_S <= end < RDZV_TIMEOUT_S + 10, ends
    assert not list(tmp_path.glob("*")), "no rank may start without a complete rendezvous"
    _assert_no_orphans(tmp_path)


@pytest.mark.timeout(90)
def test_max_restarts_restarts_every_rank_after_a_failure(tmp_path, capfd):
    from test_launcher_procs import _run_here  # the launcher in this process: no torch import to wait for

    result = _run_here(
        [
            "--num_gpus",
            "2",
            "--max_restarts",
            "1",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "launcher_steps.py"),
        ],
        _env(tmp_path, FAIL_ATTEMPT="0", STEPS_MAX="4"),
        capfd,
    )
    assert result.returncode == 0, result.stderr
    assert "RuntimeError: rank 1 fails in attempt 0" in result.stderr  # attempt 0 did fail, with its traceback
    # Both ranks were restarted (not only the failed one) and finished in attempt 1, in a world of 2.
    assert [(tmp_path / f"done{r}").read_text() for r in range(2)] == ["attempt 1 world 2"] * 2
    _assert_no_orphans(tmp_path)
