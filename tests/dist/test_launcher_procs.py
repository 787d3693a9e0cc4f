"""The launcher with real processes: fail-fast, environment, multi-node layouts, logs, signals."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import free_port
from zerospeed.launcher import agent, cli, worker
from zerospeed.launcher.runners import remote_shell_command

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = [sys.executable, "-m", "zerospeed.launcher"]
USER_ARGS = ["a b", 'say "hi"', "it's", "--num_gpus", "5", "--local_rank=7", "$HOME", ""]


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    env.update(ZS_TEST_OUT=str(out), **extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 45) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _run_here(args: list[str], env: dict[str, str], capfd) -> subprocess.CompletedProcess:
    """``zerospeed args`` with ``env``, launched from this process.

    The launcher imports torch for the elastic agent, seconds on a busy 2-core machine; this process
    has already. The ranks are real processes all the same.
    """
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        code = cli.main(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port() -> list[str]:
    """Every launch hosts its rendezvous store on --master_port: a free one, not 29500 (shared machine)."""
    return ["--master_port", str(free_port())]


def _seconds_since_failure(out: Path) -> float:
    """Seconds from launcher_fail.py's failure (just after the last pid file appeared) to now."""
    return time.time() - max(os.path.getmtime(out / f"pid{r}") for r in range(2))


def _wait_for(paths: list[Path], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path, capfd):
    result = _run_here(
        ["--num_gpus", "2", *_port(), str(SCRIPTS / "launcher_fail.py")], _env(tmp_path, FAIL_RANK="1"), capfd
    )
    assert result.returncode == 3
    assert _seconds_since_failure(tmp_path) < 10
    assert re.search(
        r"^zerospeed: rank 1 \(pid \d+\) exited with code 3; stopped the other 1 process\(es\)$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    assert not _alive(int((tmp_path / "pid0").read_text()))


@pytest.mark.timeout(60)
def test_each_rank_gets_its_environment_and_verbatim_args(tmp_path, capfd):
    port = free_port()
    result = _run_here(
        ["--num_gpus", "2", "--master_port", str(port), str(SCRIPTS / "launcher_dump.py"), *USER_ARGS],
        _env(tmp_path),
        capfd,
    )
    assert result.returncode == 0, result.stderr
    omp = str(max(1, len(os.sched_getaffinity(0)) // 2))  # this machine's cores shared by 2 processes
    for rank in range(2):
        dump = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert dump["argv"] == [str(SCRIPTS / "launcher_dump.py"), f"--local_rank={rank}", *USER_ARGS]
        assert dump["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_SIZE": "2",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "0,1",
            "OMP_NUM_THREADS": omp,
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ZEROSPEED_RANK_SPEC": None,
        }  # torch's agent's names agree; our spec is consumed


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two ranks to their own cores needs 2 cores")
def test_bind_cores_to_rank_pins_each_rank_to_its_cores(tmp_path, capfd):
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = _run_here(
        [
            "--num_gpus",
            "2",
            *_port(),
            "--bind_cores_to_rank",
            f"--bind_core_list={cores[0]},{cores[1]}",
            str(SCRIPTS / "launcher_dump.py"),
        ],
        _env(tmp_path),
        capfd,
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        dump = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert dump["affinity"] == [cores[rank]]  # what the kernel says the process may run on
        assert dump["env"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.timeout(60)
def test_user_omp_num_threads_module_and_no_local_rank(tmp_path, capfd):
    env = _env(tmp_path, OMP_NUM_THREADS="7", PYTHONPATH=str(SCRIPTS))
    result = _run_here(["--num_gpus", "1", *_port(), "--module", "--no_local_rank", "launcher_dump", "x y"], env, capfd)
    assert result.returncode == 0, result.stderr
    dump = json.loads((tmp_path / "rank0.json").read_text())
    assert dump["argv"] == [str(SCRIPTS / "launcher_dump.py"), "x y"]
    assert dump["env"]["OMP_NUM_THREADS"] == "7"


@pytest.mark.timeout(60)
def test_no_python_runs_the_script_as_an_executable(tmp_path, capfd):
    exe = tmp_path / "run dump.sh"
    dump = shlex.quote(str(SCRIPTS / "launcher_dump.py"))
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {dump} "$@"\n')
    exe.chmod(0o755)
    result = _run_here(["--num_gpus", "1", *_port(), "--no_python", str(exe), "q"], _env(tmp_path), capfd)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "rank0.json").read_text())["argv"] == [
        str(SCRIPTS / "launcher_dump.py"),
        "--local_rank=0",
        "q",
    ]


def _assert_sums(out: Path) -> None:
    assert (out / "sum0").read_text() == "0 2 3.0"
    assert (out / "sum1").read_text() == "1 2 3.0"


@pytest.mark.timeout(60)
def test_local_runner_with_a_hostfile_of_two_aliases(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    result = _run(
        [
            "--hostfile",
            str(hostfile),
            "--launcher",
            "local",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "launcher_allreduce.py"),
        ],
        _env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    _assert_sums(tmp_path)


@pytest.mark.timeout(60)
def test_local_runner_failure_stops_the_other_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    result = _run(
        [
            "--hostfile",
            str(hostfile),
            "--launcher",
            "local",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "launcher_fail.py"),
        ],
        _env(tmp_path, FAIL_RANK="1", FAIL_RAISE="1"),
    )
    assert result.returncode == 1
    assert _seconds_since_failure(tmp_path) < 10
    assert re.search(
        r"^zerospeed node 1: rank 1 \(pid \d+\) exited with code 1; stopped the other 0 process\(es\)\n"
        r"zerospeed node 1: rank 1's traceback:\nTraceback \(most recent call last\):\n"
        rf'  File "{re.escape(str(SCRIPTS))}/launcher_fail\.py", line \d+, in <module>\n'
        r".*\nRuntimeError: rank 1 fails on purpose$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    assert re.search(
        r"^zerospeed: node 1 on 127\.0\.0\.1 \(rank 1\) \(pid \d+\) exited with code 1; "
        r"stopped the other 1 process\(es\)$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    assert not _alive(int((tmp_path / "pid0").read_text()))


@pytest.mark.timeout(60)
def test_each_rank_log(tmp_path, capfd):
    logs = tmp_path / "logs"
    result = _run_here(
        ["--num_gpus", "2", *_port(), "--enable_each_rank_log", str(logs), str(SCRIPTS / "launcher_echo.py")],
        _env(tmp_path),
        capfd,
    )
    assert result.returncode == 0, result.stderr
    files = sorted(logs.iterdir())
    assert [re.fullmatch(r"\d{14}_rank(\d)\.log", f.name)[1] for f in files] == ["0", "1"]
    for rank, f in enumerate(files):
        assert sorted(f.read_text().splitlines()) == [f"stderr of rank {rank}", f"stdout of rank {rank}"]
    assert "stdout of rank" not in result.stdout


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_stops_everything(tmp_path):
    proc = subprocess.Popen(
        [*LAUNCH, "--num_gpus", "2", *_port(), "--save_pid", str(SCRIPTS / "launcher_fail.py")],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid_file = Path(f"/tmp/{proc.pid}.deepspeed")
    _wait_for([tmp_path / "pid0", tmp_path / "pid1", pid_file])
    assert pid_file.read_text() == str(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "zerospeed: received SIGTERM; stopped 2 process(es)" in err
    assert f"launcher pid: {proc.pid}" in out
    assert not any(_alive(int((tmp_path / f"pid{r}").read_text())) for r in range(2))
    assert not pid_file.exists()


@pytest.mark.timeout(60)
def test_remote_shell_line_delivers_args_verbatim(tmp_path):
    printer = "import json, os, sys; print(json.dumps([os.getcwd(), os.environ['ZS_X'], *sys.argv[1:]]))"
    (tmp_path / "a dir").mkdir()
    line = remote_shell_command(
        {"ZS_X": 'it\'s "x"'}, str(tmp_path / "a dir"), [sys.executable, "-c", printer, *USER_ARGS]
    )
    result = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert json.loads(result.stdout) == [str(tmp_path / "a dir"), 'it\'s "x"', *USER_ARGS], shlex.quote(line)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_ranks_show_the_users_command_in_ps(tmp_path, module):
    """``ps`` (the kernel's /proc/PID/cmdline) names each rank by the user's command, as torchrun's ranks,
    and each rank is the node launcher's own child (no wrapper process between them)."""
    script = "launcher_fail" if module else str(SCRIPTS / "launcher_fail.py")
    env = _env(tmp_path, PYTHONPATH=str(SCRIPTS)) if module else _env(tmp_path)
    proc = subprocess.Popen(
        [*LAUNCH, "--num_gpus", "2", *_port(), *(["--module"] if module else []), script, "x y"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], timeout=40)
        for rank in range(2):
            pid = int((tmp_path / f"pid{rank}").read_text())
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            assert args == [sys.executable, "-u", *(["-m"] if module else []), script, f"--local_rank={rank}", "x y"]
            assert psutil.Process(pid).ppid() == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


WORKER = Path(worker.__file__)
FAILING = "import sys\n{hook}def inner():\n    raise ValueError('bad input 7')\ninner()\n"


def _as_rank(tmp_path: Path, mode: str, argv: list[str], pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """Run worker.py as torch's agent starts a rank (local rank 0 of 1), with an error file to fill."""
    spec = {
        "argv": [argv],
        "mode": mode,
        "env": {},
        "cores": None,
        "log_dir": None,
        "log_prefix": "",
        "stdin_devnull": False,
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        ZEROSPEED_RANK_SPEC=json.dumps(spec),
        LOCAL_RANK="0",
        RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"),
    )
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-u", str(WORKER)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, own_hook", [("script", False), ("module", False), ("script", True)])
def test_a_rank_records_its_uncaught_exception_for_the_launcher(tmp_path, mode, own_hook):
    """The rank's start-up hook (rank_hook/sitecustomize.py) writes the error file the launcher's report
    reads, with the user's frames only; also under `python -m` and when the script installs its own
    sys.excepthook. Read back through torch's own ProcessFailure."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    hook = "sys.excepthook = lambda *exc: print('own hook', file=sys.stderr)\n" if own_hook else ""
    (tmp_path / "user.py").write_text(FAILING.format(hook=hook))
    before = int(time.time())
    argv = ["user", "--local_rank=0"] if mode == "module" else [str(tmp_path / "user.py"), "--local_rank=0"]
    result = _as_rank(tmp_path, mode, argv, pythonpath=str(tmp_path) if mode == "module" else None)
    assert result.returncode == 1
    assert ("own hook" if own_hook else "ValueError: bad input 7") in result.stderr  # python's (or its) report
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error.json"))
    assert before <= failure.timestamp <= time.time()
    tb = agent.failure_traceback(failure.error_file_data)
    # the user's frames only: no runpy frames before the script's
    assert tb.splitlines()[:2] == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path}/user.py", line {4 + bool(own_hook)}, in <module>',
    ]
    assert tb.rstrip().endswith("ValueError: bad input 7")


@pytest.mark.timeout(60)
def test_a_rank_that_exits_records_nothing(tmp_path):
    (tmp_path / "user.py").write_text("import sys\nsys.exit(3)\n")
    result = _as_rank(tmp_path, "script", [str(tmp_path / "user.py")])
    assert result.returncode == 3 and not (tmp_path / "error.json").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("users_site", [False, True], ids=["no_pythonpath", "users_sitecustomize"])
def test_a_rank_sees_its_own_pythonpath_and_sitecustomize(tmp_path, users_site):
    """The hook leaves no trace: PYTHONPATH and sys.path as given, the user's sitecustomize still runs,
    and the process's command line is the user's."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['ZS_USER_SITE'] = 'ran'\n")
    (tmp_path / "user.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'PYTHONPATH': os.environ.get('PYTHONPATH'), 'site': os.environ.get('ZS_USER_SITE'),\n"
        "                  'hook_on_path': [p for p in sys.path if 'rank_hook' in p],\n"
        "                  'cmdline': open('/proc/self/cmdline').read().split(chr(0))[:-1]}))\n"
    )
    given = str(site) if users_site else None
    result = _as_rank(tmp_path, "script", [str(tmp_path / "user.py"), "a"], pythonpath=given)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {
        "PYTHONPATH": given,
        "site": "ran" if users_site else None,
        "hook_on_path": [],
        "cmdline": [sys.executable, "-u", str(tmp_path / "user.py"), "a"],
    }
