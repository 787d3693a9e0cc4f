"""Config keys that set process-wide state once per engine: `log_level` and `disable_python_gc`.

Note [python gc while engines live]: `disable_python_gc: true` (DeepSpeed 0.19.8) turns off Python's
automatic cyclic collector from `initialize` until the engine's `destroy()`: a collection pass over a
large heap stalls every rank at a random point of the step, and the ranks wait for the slowest one.
Reference counting still frees tensors; only cycles wait for an explicit `engine.collect_python_gc()`
at a boundary the user picks. The state is process-wide, so it is counted: the first engine that
asks collects once and disables, the last one released restores the collector if it was on before.
A forked child (a DataLoader worker) starts with the collector back on and no engines counted.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

from zerospeed.utils.errors import ConfigError

LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def apply_log_level(level: str | None, logger_name: str = "zerospeed") -> None:
    """`log_level`: set zerospeed's logger (and its handlers) to that level, as DeepSpeed sets its own
    logger; None leaves the logger as it is. Raises ConfigError naming the key for an unknown level."""
    if level is None:
        return
    value = LOG_LEVELS.get(level.lower())
    if value is None:
        raise ConfigError(f"log_level={level!r}: expected one of {', '.join(LOG_LEVELS)} (case-insensitive)")
    log = logging.getLogger(logger_name)
    log.setLevel(value)
    for handler in log.handlers:
        handler.setLevel(value)


class PythonGC:
    """Note [python gc while engines live]: the process's count of engines that turned the collector off."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._holders = 0
        self._restore = False
        self._generation = 0  # bumped in a forked child: tokens taken in the parent no longer count
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forked)

    @property
    def holders(self) -> int:
        return self._holders

    def acquire(self) -> int:
        """Turn the collector off (collecting once first) unless another engine already did; returns a token."""
        with self._lock:
            if self._holders == 0:
                self._restore = gc.isenabled()
                if self._restore:
                    gc.collect()
                    gc.disable()
            self._holders += 1
            return self._generation

    def release(self, token: int) -> None:
        """Give back `token`; the last holder turns the collector back on if it was on before."""
        with self._lock:
            if token != self._generation or self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0 and self._restore:
                self._restore = False
                gc.enable()

    def collect(self) -> int:
        """An explicit collection; the automatic collector stays as it is."""
        return gc.collect()

    def _forked(self) -> None:
        if self._holders and self._restore:
            gc.enable()
        self._holders, self._restore, self._lock = 0, False, threading.RLock()
        self._generation += 1


PYTHON_GC = PythonGC()


def hold_python_gc(engine, disable: bool) -> None:
    """`disable_python_gc`: the engine holds the collector off until `release_python_gc(engine)`."""
    if disable:
        engine.__dict__["_python_gc_token"] = PYTHON_GC.acquire()


def release_python_gc(engine) -> None:
    """At the engine's `destroy()`: give back what `hold_python_gc` took (once)."""
    token = engine.__dict__.pop("_python_gc_token", None)
    if token is not None:
        PYTHON_GC.release(token)
