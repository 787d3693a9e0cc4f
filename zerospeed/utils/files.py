"""Crash-safe file writes with the standard library only: a killed process never leaves a half-written file.

A file is written to a temporary name in the same directory, flushed, fsync'ed and renamed over its
final name (rename is atomic on POSIX), and the directory entry is fsync'ed too. Checkpoints
(zerospeed/checkpoint/atomic.py adds the directory swap and torch.save) and the plots of
zerospeed/monitor/plot.py write this way; nothing here imports torch, so `zerospeed-plot` starts without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None], buffering: int = -1) -> None:
    """Call `write(file)` on a temporary file (opened with `buffering`, open()'s argument: -1 the default
    buffer), then fsync it and rename it to `path`."""

    def write_named(tmp: Path) -> None:
        with open(tmp, "wb", buffering=buffering) as f:
            write(f)

    atomic_write_named(path, write_named)


def atomic_write_named(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(temporary path)` (for a writer that opens the file itself, such as a library's
    `save_file`), then fsync that file and rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
