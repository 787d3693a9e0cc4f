"""The first code of every rank: turns a worker of torch's elastic agent into a zerospeed rank.

The agent (``agent.py``) starts ``python -u <this file>`` once per local rank with its own variables
(``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ...). This file then, in the same process (same pid, so the
agent's supervision is unchanged):

1. adds zerospeed's variables derived from the agent's (``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``)
   and the node's (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), from ``ZEROSPEED_RANK_SPEC``;
2. asks Linux to SIGTERM it when the node launcher dies, binds it to its cores, redirects its output to
   its ``--enable_each_rank_log`` file;
3. becomes the user's command, ``python -u train.py --local_rank=N ...`` (or ``python -u -m module``,
   or the ``--no_python`` executable), by exec: Note [the rank runs the user's command].

Stdlib only: a rank starts without importing zerospeed or torch.
"""

import sys

if __name__ == "__main__":
    del sys.path[0]  # this directory: its modules must not shadow the stdlib or the user's modules

import ctypes
import json
import os
import signal
from collections.abc import Mapping

SPEC_VAR = "ZEROSPEED_RANK_SPEC"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_hook")  # the ranks' sitecustomize.py


def zerospeed_variables(agent_env: Mapping[str, str]) -> dict[str, str]:
    """zerospeed's (DeepSpeed's) names for what the agent tells a worker under torch's names."""
    return {
        "LOCAL_SIZE": agent_env["LOCAL_WORLD_SIZE"],
        "CROSS_RANK": agent_env["GROUP_RANK"],
        "CROSS_SIZE": agent_env["GROUP_WORLD_SIZE"],
    }


def log_path(log_dir: str, prefix: str, rank: str) -> str:
    """The ``--enable_each_rank_log`` file of global rank ``rank``."""
    return os.path.join(log_dir, f"{prefix}_rank{rank}.log")


def _die_with_parent() -> None:
    # Note [ranks die with their node launcher]: the agent starts each worker in its own session and
    # stops it on a signal, but a launcher killed with SIGKILL cannot; without this its ranks would
    # run on forever (and block their peers' collectives) as orphans.
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _redirect(log_file: str | None, stdin_devnull: bool) -> None:
    if log_file is not None:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if stdin_devnull:  # the ssh runner's launcher watches stdin; ranks must not read it
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)


def pythonpath_with(value: str | None, entry: str) -> str:
    """``PYTHONPATH`` with ``entry`` first (``value``: the one the rank was given; None if none)."""
    return entry if value is None else entry + os.pathsep + value


def command_line(mode: str, argv: list[str], python: str) -> list[str]:
    """The rank's command line: what ``ps`` shows, as for a rank that torchrun started."""
    if mode == "exec":
        return list(argv)
    return [python, "-u", *(["-m"] if mode == "module" else []), *argv]


def _become(mode: str, argv: list[str]) -> None:
    # Note [the rank runs the user's command]: a rank's process shows the user's command line in `ps`
    # (python -u train.py --local_rank=0 ...), as torchrun's and DeepSpeed's ranks do, because users
    # find and kill their jobs by script name. So this file sets the rank up and then exec's that
    # command: execve keeps the pid (the agent still supervises it), the environment, the core
    # affinity, the parent-death signal and the redirected descriptors, and replaces only the program.
    # Starting the command from the agent directly would leave nowhere to set the parent-death signal
    # and the affinity before the user's code runs (torch's agent offers no pre-exec hook) and no way to
    # do it for a --no_python executable. What the exec loses is this file's code around the script,
    # which recorded an uncaught exception for the launcher's report; a start-up hook that Python
    # runs in that process only does that now (rank_hook/sitecustomize.py: it takes its directory off
    # PYTHONPATH again first). An executable (--no_python) gets no hook: its exit code is its report.
    if mode != "exec":
        os.environ["PYTHONPATH"] = pythonpath_with(os.environ.get("PYTHONPATH"), HOOK_DIR)
    line = command_line(mode, argv, sys.executable)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(line[0], line, os.environ)


def main() -> None:
    """Become the rank the agent started: see the module docstring."""
    spec = json.loads(os.environ.pop(SPEC_VAR))
    local_rank = int(os.environ["LOCAL_RANK"])
    os.environ.update(spec["env"])
    os.environ.update(zerospeed_variables(os.environ))
    _die_with_parent()
    if spec["cores"] is not None:
        os.sched_setaffinity(0, spec["cores"][local_rank])
    log = log_path(spec["log_dir"], spec["log_prefix"], os.environ["RANK"]) if spec["log_dir"] else None
    _redirect(log, spec["stdin_devnull"])
    _become(spec["mode"], spec["argv"][local_rank])


if __name__ == "__main__":
    main()
