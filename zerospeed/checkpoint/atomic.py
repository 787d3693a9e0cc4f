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

import torch

from zerospeed.utils.files import atomic_write, fsync_dir


def atomic_torch_save(obj, path: Path, buffering: int = -1) -> None:
    """torch.save `obj` to `path` crash-safely, through a file buffer of `buffering` bytes (-1: the default)."""
    atomic_write(path, lambda f: torch.save(obj, f), buffering=buffering)


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
