"""Crash-safe file and directory writes: a killed process never leaves a half-written file in place.

Every file is written to a temporary name in the same directory, flushed, fsync'ed and renamed over
its final name (rename is atomic on POSIX), and the directory entry is fsync'ed too.

Note [tag directory swap]: a save writes all files into `.{tag}.partial`, then renames it to
`{tag}`. Renaming a directory over a non-empty one is impossible, so re-saving an existing tag first
moves the old one to `.{tag}.previous`, renames the new one in and deletes the old. A crash between
those two renames leaves no `{tag}` but a complete `.{tag}.previous`, which loading falls back to;
at every moment a complete copy of the tag exists under one of the two names.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

import torch


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


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temporary file, then fsync it and rename it to `path`."""
    def write_named(tmp: Path) -> None:
        with open(tmp, "wb") as f:
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


def atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (memory stays at one chunk)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def fresh_dir(path: Path) -> None:
    """An empty directory at `path` (a leftover from an interrupted save is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def swap_in_dir(staging: Path, final: Path, previous: Path) -> None:
    """Rename the complete `staging` directory to `final`, replacing any old one (Note [tag directory swap])."""
    if final.exists():
        if previous.exists():
            shutil.rmtree(previous)  # left over from a swap that completed: `final` is the complete copy
        os.rename(final, previous)
        fsync_dir(final.parent)
    # Without `final`, an existing `previous` may be the only complete copy: delete it only afterwards.
    os.rename(staging, final)
    fsync_dir(final.parent)
    if previous.exists():
        shutil.rmtree(previous, ignore_errors=True)
