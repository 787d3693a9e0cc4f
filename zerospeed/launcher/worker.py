"""The first code of every rank: turns a worker of torch's elastic agent into a zerospeed rank.

The agent (``agent.py``) starts ``python -u <this file>`` once per local rank with its own variables
(``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ...). This file then, in the same process (same pid, so the
agent's supervision is unchanged):

1. adds zerospeed's variables derived from the agent's (``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``)
   and the node's (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``), from ``ZEROSPEED_RANK_SPEC``;
2. asks Linux to SIGTERM it when the node launcher dies, binds it to its cores, redirects its output to
   its ``--enable_each_rank_log`` file;
3. runs the user's script (or module) here, recording an uncaught exception in the agent's error file,
   so the launcher prints the failing rank's traceback; an executable (``--no_python``) is exec'ed.

Stdlib only: a rank starts without importing zerospeed or torch (torch only to record a failure).
"""
import sys

if __name__ == "__main__":
    del sys.path[0]  # this directory: its modules must not shadow the stdlib or the user's modules

import ctypes
import json
import os
import runpy
import signal
import time
import traceback
from collections.abc import Mapping
from types import TracebackType

SPEC_VAR = "ZEROSPEED_RANK_SPEC"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def zerospeed_variables(agent_env: Mapping[str, str]) -> dict[str, str]:
    """zerospeed's (DeepSpeed's) names for what the agent tells a worker under torch's names."""
    return {"LOCAL_SIZE": agent_env["LOCAL_WORLD_SIZE"], "CROSS_RANK": agent_env["GROUP_RANK"],
            "CROSS_SIZE": agent_env["GROUP_WORLD_SIZE"]}


def log_path(log_dir: str, prefix: str, rank: str) -> str:
    """The ``--enable_each_rank_log`` file of global rank ``rank``."""
    return os.path.join(log_dir, f"{prefix}_rank{rank}.log")


def _ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the leading frames of this file and of runpy: the traceback python would print."""
    while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


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


def error_record(exc: BaseException, now: float) -> dict:
    """``exc`` as torch's ``ErrorHandler.record_exception`` writes it (what the agent's report reads).

    Note [error file without torch]: written here rather than through torch's ErrorHandler, so that a
    failing rank of a script that never imported torch does not import it (seconds) on its way out.
    tests/unit/test_launcher_agent_parts.py reads this record back through torch's ``ProcessFailure``.
    """
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))}}}


def _record(exc: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump(error_record(exc, time.time()), f)


def _run(mode: str, argv: list[str]) -> None:
    if mode == "exec":
        os.execvp(argv[0], argv)
    sys.argv = list(argv)
    try:
        if mode == "module":
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except Exception as exc:  # noqa: BLE001 (SystemExit and KeyboardInterrupt pass through untouched)
        # What python does with an uncaught exception (print it through sys.excepthook, exit 1), but
        # with the traceback starting in the user's code, and recorded for the launcher's report.
        exc.__traceback__ = user_frames(exc.__traceback__)
        _record(exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


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
    _run(spec["mode"], spec["argv"][local_rank])


if __name__ == "__main__":
    main()
