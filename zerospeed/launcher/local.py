"""Starting and supervising the per-node processes of a multi-node job.

The children are node launchers (``--launcher local``) or the ssh / pdsh / mpirun / srun processes
that start them; each node's ranks are run by torch's elastic agent inside its node launcher
(``agent.py``), not here. Each child runs in its own session (hence its own process group), so it
can be stopped together with everything it started by signalling the group.
The rules: when a child exits non-zero, every other child is stopped within seconds and the
launcher exits with that child's code; a SIGINT/SIGTERM/SIGHUP to the launcher is forwarded to all
children; nothing is left running when the launcher returns.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

GRACE_S = 3.0  # SIGTERM/SIGINT first; SIGKILL whatever is still alive after this
POLL_S = 0.1  # how often exits are checked; bounds the reaction time to a failure
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class ChildSpec:
    """One process to start."""

    label: str  # how messages name it: "node 0 on worker-0 (ranks 0-1)", "pdsh"
    argv: Sequence[str]
    env: dict[str, str]
    stdin: str = "inherit"  # "inherit", "devnull" or "pipe" (kept open until the child ends)


@dataclass
class _Child:
    spec: ChildSpec
    popen: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class _Stop:
    """Why supervision must end early: a signal to the launcher."""

    signum: int | None = None
    reason: str = ""
    saved: dict[int, object] = field(default_factory=dict)


def run_children(
    specs: Sequence[ChildSpec],
    *,
    grace_s: float = GRACE_S,
    on_stop: Callable[[], None] | None = None,
    name: str = "zerospeed",
) -> int:
    """Start ``specs``, supervise them and return the exit code for the launcher.

    ``on_stop`` runs once when the children are being stopped early (the pdsh runner uses it to
    kill the remote processes). ``name`` starts every message this prints.
    """
    stop = _Stop()
    _install_handlers(stop)
    children: list[_Child] = []
    try:
        for spec in specs:
            try:
                children.append(_Child(spec, _spawn(spec)))
            except OSError as err:
                _stop_all(children, signal.SIGTERM, grace_s)
                print(f"{name}: cannot start {spec.label} ({spec.argv[0]}): {err}", file=sys.stderr)
                # The shell's codes for "command not found" and "not executable".
                return {FileNotFoundError: 127, PermissionError: 126}.get(type(err), 1)
        return _supervise(children, _Settings(name, stop, grace_s, on_stop))
    finally:
        _restore_handlers(stop)
        for c in children:
            if c.popen.stdin is not None:
                c.popen.stdin.close()


def _spawn(spec: ChildSpec) -> subprocess.Popen:
    stdin = {"inherit": None, "devnull": subprocess.DEVNULL, "pipe": subprocess.PIPE}[spec.stdin]
    popen = subprocess.Popen(
        list(spec.argv), env=spec.env, stdin=stdin, start_new_session=True, preexec_fn=_die_with_parent_hook()
    )
    logger.debug("started %s (pid %d): %s", spec.label, popen.pid, list(spec.argv))
    return popen


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child if the launcher dies (even by SIGKILL).

    Without it a launcher killed with SIGKILL would leave its children, which live in their own
    sessions, running forever (a node launcher then stops its ranks: Note [ranks die with their
    node launcher] in worker.py).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to load in the child
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def _install_handlers(stop: _Stop) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (e.g. a test calling main)

    def handler(signum: int, _frame: object) -> None:
        if stop.signum is None:
            stop.signum, stop.reason = signum, f"received {signal.Signals(signum).name}"

    for sig in _FORWARDED:
        stop.saved[sig] = signal.signal(sig, handler)


def _restore_handlers(stop: _Stop) -> None:
    for sig, previous in stop.saved.items():
        signal.signal(sig, previous)


@dataclass(frozen=True)
class _Settings:
    name: str
    stop: _Stop
    grace_s: float
    on_stop: Callable[[], None] | None


def _supervise(children: list[_Child], cfg: _Settings) -> int:
    while True:
        failed = next((c for c in children if c.popen.poll() not in (None, 0)), None)
        if failed is not None:
            return _fail(children, failed, cfg)
        if cfg.stop.signum is not None:
            return _interrupt(children, cfg)
        if not any(c.alive for c in children):
            return 0
        time.sleep(POLL_S)


def _fail(children: list[_Child], failed: _Child, cfg: _Settings) -> int:
    others = [c for c in children if c is not failed and c.alive]
    if cfg.on_stop is not None:
        cfg.on_stop()
    _stop_all(children, signal.SIGTERM, cfg.grace_s)
    code = failed.popen.returncode
    how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    print(
        f"{cfg.name}: {failed.spec.label} (pid {failed.popen.pid}) {how}; stopped the other {len(others)} process(es)",
        file=sys.stderr,
        flush=True,
    )
    return 128 - code if code < 0 else code


def _interrupt(children: list[_Child], cfg: _Settings) -> int:
    alive = [c for c in children if c.alive]
    if cfg.on_stop is not None:
        cfg.on_stop()
    # Ctrl-C reaches the children as SIGINT (a Python rank gets KeyboardInterrupt and can clean
    # up); anything else as SIGTERM.
    signum = cfg.stop.signum
    _stop_all(children, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM, cfg.grace_s)
    print(f"{cfg.name}: {cfg.stop.reason}; stopped {len(alive)} process(es)", file=sys.stderr, flush=True)
    return 128 + signum


def _stop_all(children: list[_Child], first: int, grace_s: float) -> None:
    """Signal every child's process group, wait up to ``grace_s``, then SIGKILL the groups."""
    for c in children:
        _signal_group(c, first)
    deadline = time.monotonic() + grace_s
    while any(c.alive for c in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    for c in children:
        # Also groups whose leader already exited: its own children may still be running.
        _signal_group(c, signal.SIGKILL)
        c.popen.wait()


def _signal_group(child: _Child, sig: int) -> None:
    try:
        os.killpg(child.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
