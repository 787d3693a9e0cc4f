"""Start-up hook of a rank's Python: records the rank's uncaught exception for the launcher's report.

``worker.py`` exec's a rank's command (``python -u train.py ...``) with this directory first on
``PYTHONPATH``, so Python's ``site`` imports this file as ``sitecustomize`` before the user's script
runs (Note [the rank runs the user's command] in worker.py). It then, in that process only:

1. leaves: takes this directory off ``sys.path`` and ``PYTHONPATH`` again (the user's own processes
   started from the rank see the ``PYTHONPATH`` the rank was given) and runs the ``sitecustomize``
   this one shadowed, if there is one;
2. at exit, writes an uncaught exception to torch elastic's error file (``TORCHELASTIC_ERROR_FILE``),
   from which the launcher prints the failing rank's traceback.

Stdlib only, and nothing of zerospeed: it runs in every rank before the user's code, also in scripts
that never import zerospeed or torch. Imported under its package name (by tests) it does nothing.
"""

import atexit
import json
import os
import sys
import time
import traceback
from types import TracebackType

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_PID = os.getpid()  # a child the user's code forks runs these atexit functions too; it records nothing


def error_record(exc: BaseException, now: float) -> dict:
    """``exc`` as torch's ``ErrorHandler.record_exception`` writes it (what the agent's report reads).

    Note [error file without torch]: written here rather than through torch's ErrorHandler, so that a
    failing rank of a script that never imported torch does not import it (seconds) on its way out.
    tests/unit/test_launcher_agent_parts.py reads this record back through torch's ``ProcessFailure``.
    """
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))},
        }
    }


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the leading frames of runpy (``python -m``): the traceback starts in the user's code."""
    while tb is not None and tb.tb_next is not None and _runpy(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _runpy(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.basename(filename) == "runpy.py"


def pythonpath_without(value: str, entry: str) -> str | None:
    """The ``PYTHONPATH`` before ``entry`` was put first in it (None: there was none); inverse of
    ``worker.pythonpath_with``."""
    if value == entry:
        return None
    return value[len(entry) + 1 :] if value.startswith(entry + os.pathsep) else value


def record_uncaught_exception() -> None:
    """At exit: the exception that ended the main module, if one did, into the agent's error file.

    Note [uncaught exception at exit]: Python keeps the exception that ended ``__main__`` in
    ``sys.last_value`` (set before ``sys.excepthook`` prints it) and runs the ``atexit`` functions
    afterwards. Reading it here, rather than wrapping ``sys.excepthook``, still works when the user's
    script installs its own hook (rich, IPython-style tracebacks). SystemExit never lands there, and a
    KeyboardInterrupt (Ctrl-C reaches every rank) is no failure of the script: neither is recorded.
    """
    exc = getattr(sys, "last_value", None)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not isinstance(exc, Exception) or os.getpid() != RANK_PID:
        return
    exc.__traceback__ = user_frames(exc.__traceback__)
    with open(path, "w") as f:
        json.dump(error_record(exc, time.time()), f)


def _leave() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    original = pythonpath_without(os.environ.get("PYTHONPATH", ""), HERE)
    if original is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = original
    # Chain: the sitecustomize this file shadows (a distribution's or a user's) runs as it would have.
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the next one on sys.path, this directory being gone)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = me  # there is none: importlib expects this module back


if __name__ == "sitecustomize" and HERE in map(os.path.abspath, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    atexit.register(record_uncaught_exception)
    _leave()
