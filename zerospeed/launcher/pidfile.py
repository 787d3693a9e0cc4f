"""``--save_pid``: the pid file DeepSpeed's launcher writes for programs that drive it.

DeepSpeed writes ``/tmp/<main-pid>.deepspeed`` holding the pid of the process that supervises
the ranks, where ``<main-pid>`` is the pid of the ``deepspeed`` command the program started. A
program can then find and signal that process. The same name is kept so such programs keep working.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from zerospeed.launcher.errors import LauncherError

PID_FILE_DIR = "/tmp"  # DeepSpeed's fixed location (not $TMPDIR), which callers look in


def pid_file_path(main_pid: int, directory: str = PID_FILE_DIR) -> str:
    """Path of the pid file for the launch started as process ``main_pid``."""
    return os.path.join(directory, f"{main_pid}.deepspeed")


@contextlib.contextmanager
def saved_pid(main_pid: int | None, directory: str = PID_FILE_DIR) -> Iterator[None]:
    """Write this process's pid to the pid file of ``main_pid`` for the duration of the block.

    ``main_pid=None`` does nothing. The file is removed when the block ends, however it ends.
    """
    if main_pid is None:
        yield
        return
    path = pid_file_path(main_pid, directory)
    try:
        with open(path, "x") as f:
            f.write(str(os.getpid()))
    except FileExistsError:
        raise LauncherError(
            f"--save_pid: {path} already exists; another launch with the same "
            "main pid is running, or a stale file needs removing"
        ) from None
    print(f"launcher pid: {os.getpid()}", flush=True)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
