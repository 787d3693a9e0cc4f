"""Running one node's ranks through PyTorch's elastic agent (``LocalElasticAgent``).

The agent starts, watches and stops the node's worker processes, restarts them (``--max_restarts``),
and meets the other nodes' agents in a c10d rendezvous whose store node 0 hosts on
``--master_addr:--master_port``. zerospeed adds: the ranks' zerospeed variables and core binding
(``worker.py``, which then exec's the user's command), node order = hostfile order (``NodeRendezvous``
in ``rendezvous.py``), and messages that name the failing rank with its traceback, or the node that
never arrived.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerospeed.launcher.rendezvous import NodeRendezvous, RendezvousPlan, timeout_message, unreachable_message
from zerospeed.launcher.worker import SPEC_VAR, log_path

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

logger = logging.getLogger(__name__)

WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
GRACE_S = 3  # SIGTERM first; SIGKILL what is still running after this (the agent's shutdown timeout)
EXIT_BARRIER_S = 60  # Note [short exit barrier]
MONITOR_S = 0.1  # how often the agent checks its workers; bounds the reaction time to a failure


def exit_code(exitcode: int) -> int:
    """The launcher's code for a rank's: its own, or 128 + N when signal N killed it (as a shell)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def failure_traceback(error_file_data: Mapping[str, Any]) -> str | None:
    """The traceback a rank recorded in its error file (``rank_hook/sitecustomize.py``), if it recorded one."""
    message = error_file_data.get("message")
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("py_callstack") or message.get("message")
    return None


def root_failures(exitcodes: Mapping[int, int]) -> list[int]:
    """The ranks whose failure brought the node down, from every failed rank's exit code (pure).

    The agent stops the other ranks with SIGTERM (SIGKILL after ``GRACE_S``) and reports them as
    failed too. So: ranks that failed by themselves; else ranks killed by SIGKILL (the OOM killer);
    else all (SIGTERM from outside).
    """
    for kind in (lambda c: c not in (-15, -9), lambda c: c == -9):
        ranks = sorted(r for r, c in exitcodes.items() if kind(c))
        if ranks:
            return ranks
    return sorted(exitcodes)


def failure_report(name: str, rank: int, failure: ProcessFailure, others: int, log: str | None) -> str:
    """``zerospeed: rank 1 (pid 12) exited with code 3; stopped the other 1 process(es)`` + traceback."""
    code = failure.exitcode
    how = f"was killed by signal {failure.signal_name()}" if code < 0 else f"exited with code {code}"
    where = f"; its output is in {log}" if log else ""
    line = f"{name}: rank {rank} (pid {failure.pid}) {how}; stopped the other {others} process(es){where}"
    tb = failure_traceback(failure.error_file_data)
    return line if tb is None else f"{line}\n{name}: rank {rank}'s traceback:\n{tb.rstrip()}"


@dataclass(frozen=True)
class AgentJob:
    """Everything ``run_agent`` needs to run one node's ranks."""

    plan: RendezvousPlan
    local_world_size: int
    worker_spec: str  # JSON for worker.py: node.worker_spec(...)
    max_restarts: int = 0
    log_dir: str | None = None  # --enable_each_rank_log
    log_prefix: str = ""
    name: str = "zerospeed"  # starts every message


def run_agent(job: AgentJob, *, watch_stdin: bool = False) -> int:
    """Run ``job`` under torch's ``LocalElasticAgent``; print what went wrong; return the exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    try:
        rdzv = NodeRendezvous(job.plan)
    except RendezvousConnectionError as err:
        return _error(job, unreachable_message(job.plan, err.__cause__ or err))
    error_dir = tempfile.mkdtemp(prefix="zerospeed_agent_")  # the ranks' error files (tracebacks)
    stdin_lost = _watch_stdin() if watch_stdin else None
    saved = _saved_signal_handlers()  # the agent replaces them for good; run_node may be called from Python
    shutdown = True
    try:
        result = _make_agent(job, rdzv, error_dir).run()
    except RendezvousTimeoutError:
        return _error(job, timeout_message(job.plan, rdzv.missing()))
    except SignalException as sig:
        # Note [no shutdown on a signal]: as torch's launch_agent does, the rendezvous stays open so
        # that, with elasticity, the other nodes can go on without this one.
        shutdown = False
        reason = (
            "lost the job's launcher (stdin closed)"
            if stdin_lost and stdin_lost.is_set()
            else f"received {sig.sigval.name}"
        )
        print(f"{job.name}: {reason}; stopped {job.local_world_size} process(es)", file=sys.stderr, flush=True)
        return 128 + int(sig.sigval)
    finally:
        if shutdown:
            rdzv.shutdown()
        shutil.rmtree(error_dir, ignore_errors=True)
        os.environ.pop(SPEC_VAR, None)
        _restore_signal_handlers(saved)
    if not result.is_failed():
        return 0
    return _report_failures(job, result.failures)


def _error(job: AgentJob, message: str) -> int:
    print(f"{job.name}: error: {message}", file=sys.stderr, flush=True)
    return 1


def _make_agent(job: AgentJob, rdzv: Any, error_dir: str) -> Any:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    os.environ[SPEC_VAR] = job.worker_spec  # the agent starts every worker with this process's environment
    # The ranks' MASTER_ADDR/MASTER_PORT come from rdzv (Note [the ranks' store] in rendezvous.py).
    spec = WorkerSpec(
        role="rank",
        local_world_size=job.local_world_size,
        entrypoint=sys.executable,
        args=("-u", WORKER_FILE),
        rdzv_handler=rdzv,
        max_restarts=job.max_restarts,
        monitor_interval=MONITOR_S,
    )
    # Note [short exit barrier]: a node whose ranks finished waits at torch's exit barrier for the other
    # nodes (300 s by default), ignoring SIGTERM meanwhile; when a peer failed, that is minutes of a
    # launcher with no ranks. A minute covers nodes finishing at different times (a final checkpoint).
    return LocalElasticAgent(
        spec,
        logs_specs=DefaultLogsSpecs(log_dir=error_dir),
        shutdown_timeout=GRACE_S,
        exit_barrier_timeout=EXIT_BARRIER_S,
    )


_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torch's TORCHELASTIC_SIGNALS_TO_HANDLE default


def _saved_signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (getattr(signal, name) for name in _AGENT_SIGNALS)}


def _restore_signal_handlers(saved: Mapping[int, Any]) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _watch_stdin() -> Any:
    """A thread that SIGHUPs this process when stdin closes (the ssh runner's launcher is gone)."""
    lost = threading.Event()

    def watch() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        lost.set()
        os.kill(os.getpid(), signal.SIGHUP)  # the agent stops the ranks on SIGHUP

    threading.Thread(target=watch, name="zerospeed-stdin", daemon=True).start()
    return lost


def _report_failures(job: AgentJob, failures: Mapping[int, ProcessFailure]) -> int:
    roots = root_failures({rank: f.exitcode for rank, f in failures.items()})
    others = job.local_world_size - len(roots)
    for rank in roots:
        log = log_path(job.log_dir, job.log_prefix, str(rank)) if job.log_dir else None
        print(failure_report(job.name, rank, failures[rank], others, log), file=sys.stderr, flush=True)
    if job.max_restarts:
        print(f"{job.name}: gave up after --max_restarts {job.max_restarts} restart(s)", file=sys.stderr, flush=True)
    return exit_code(failures[roots[0]].exitcode)
