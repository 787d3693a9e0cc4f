"""Asynchronous checkpoint saves: a host snapshot taken in the training loop, persisted by a background thread.

`save_checkpoint` with an asynchronous `WriterPlan` copies what this rank saves into host memory (pinned
on an accelerator, so the copies run at full speed; a plain copy on the CPU), hands the copies to a
`BackgroundWriter` and returns: training goes on while the thread serialises, writes and fsyncs the
files into the tag's staging directory. The save becomes a checkpoint — manifest written, staging
directory renamed to the tag, `latest` moved — only at a commit (save.py, `commit_save`), which runs in
the training loop at the next sync point: the next optimizer step, the next save or load,
`engine.wait_for_checkpoint()` or `engine.destroy()`.

Note [no collectives off the training thread]: a commit must know that every rank's files are durable
before `latest` moves, which takes a collective; the background thread never calls one. A collective
from a second thread would interleave with the training thread's collectives on the same process group
in an order that differs between ranks (rank 0's writer might finish during a forward, rank 1's during
the backward), and NCCL and gloo match collectives by issue order: the job would deadlock or exchange
the wrong buffers. So the thread only writes files and sets a flag; the training thread, at points that
every rank reaches in the same order (an accumulation boundary's step, a save, a load, a wait), asks
all ranks whether their flags are set (one tiny all-gather) and commits when all are. The answer is
the same on every rank, so every rank takes the same branch and the collectives stay matched.

Note [one save in flight]: a second save first commits the first (waiting for its writer when it is
not done), so at most one snapshot is held in host memory and tags commit in the order they were saved.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerospeed.utils.files import atomic_write

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterPlan:
    """How checkpoints are written, resolved once from the config (`checkpoint.writer`, `datastates_ckpt`,
    `casync_ckpt`, `async_load`, `checkpoint.use_node_local_storage`; docs/checkpoints.md maps each key)."""

    asynchronous: bool = False  # save_checkpoint returns after the host snapshot
    io_buffer_bytes: int = 1 << 20  # the file buffer each checkpoint file is written through
    show_statistics: bool = False  # log bytes, seconds and GB/s of every save
    host_cache_bytes: int | None = None  # a snapshot larger than this is written synchronously instead
    async_load: bool = False  # load reads this rank's files on background threads, overlapping one another
    node_local: bool = False  # every node writes (and reads) its own copy of the checkpoint
    deepspeed_layout: bool = False  # ZeRO 0-3: files DeepSpeed loads as saved (checkpoint/deepspeed_layout.py)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class SnapshotPool:
    """Host buffers for snapshots, reused from one save to the next.

    Note [snapshot buffers]: a snapshot's first touch of fresh memory is most of its cost (a 124M model's
    1.25 GB took 4 s to copy into new pages on the benchmark machine, 0.5 s into pages already mapped), and
    pinned memory is slow to allocate on a GPU host. The shapes and dtypes of a training state do not change
    between saves, so the buffers one save filled take the next save's copies once its writer is done with
    them (`release`, at the commit: one save is in flight at a time). The price: the host memory of one
    snapshot stays allocated while training runs (DataStates' `host_cache_size` bounds it)."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, shape: tuple, dtype: torch.dtype, pinned_empty: Callable | None) -> torch.Tensor:
        free = self._free.get((shape, dtype, pinned_empty is not None))
        buf = free.pop() if free else (pinned_empty or torch.empty)(shape, dtype=dtype)
        self._lent.append(buf)
        return buf

    def release(self) -> None:
        """The snapshot lent last is written: its buffers serve the next one (any left unused are dropped)."""
        self._free = {}
        for buf in self._lent:
            self._free.setdefault((tuple(buf.shape), buf.dtype, buf.is_pinned()), []).append(buf)
        self._lent = []


class _Snapshotter:
    """Copies a state object's tensors into host memory, keeping tensors that were one tensor one copy."""

    def __init__(self, pinned_empty: Callable | None, pool: SnapshotPool | None):
        self.pinned_empty = pinned_empty
        self.pool = pool if pool is not None else SnapshotPool()
        self.copies: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0
        self.device_copies = False

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        key = _tensor_key(t)
        if key not in self.copies:
            t = t.detach()
            on_device = t.device.type != "cpu" and self.pinned_empty is not None
            host = self.pool.take(tuple(t.shape), t.dtype, self.pinned_empty if on_device else None)
            host.copy_(t, non_blocking=on_device)  # a device copy finishes at the one synchronize at the end
            self.device_copies |= on_device
            self.copies[key] = host
            self.nbytes += host.nbytes
        return self.copies[key]

    def copy(self, obj):
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            return type(obj)((k, self.copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self.copy(v) for v in obj)
        if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
            return obj
        return copy.deepcopy(obj)  # anything else the training loop might still mutate


def host_snapshot(
    objs: list,
    pinned_empty: Callable | None = None,
    synchronize: Callable | None = None,
    pool: SnapshotPool | None = None,
):
    """(copies of `objs` whose tensors live in host memory and share nothing with the originals, bytes copied).

    Device tensors land in `pinned_empty` buffers (the accelerator's pinned allocator) through
    asynchronous copies, finished by one `synchronize()` at the end; buffers come from `pool` when given
    (Note [snapshot buffers])."""
    snap = _Snapshotter(pinned_empty, pool)
    out = [snap.copy(o) for o in objs]
    if snap.device_copies and synchronize is not None:
        synchronize()
    return out, snap.nbytes


def payload_bytes(obj) -> int:
    """The bytes of the distinct tensors in `obj`: what its snapshot takes, and what writing it needs give or
    take the pickle (once views are compact)."""
    seen: dict[tuple, int] = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            seen[_tensor_key(o)] = o.nbytes
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(seen.values())


def _describe_write_error(exc: BaseException, path: Path, needed: int) -> str:
    """The error a failed checkpoint write reports: for a full disk the path, the bytes this rank's files
    need and the bytes free there."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes are free there"
        except OSError:
            free = "the free space could not be read"
        return (
            f"no space left on the device writing checkpoint file {path}: this rank's checkpoint files need "
            f"about {needed:,} bytes and {free}; the previous checkpoint and `latest` are untouched — free "
            "space or save elsewhere"
        )
    return f"could not write checkpoint file {path}: {type(exc).__name__}: {exc}"


class _HashingWriter:
    """A binary file that hashes what passes through it: the manifest's sha256 without reading the file back."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.nbytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def hashed_torch_save(obj, path: Path, buffering: int = -1, pickle_module=None) -> dict:
    """torch.save `obj` crash-safely to `path` (checkpoint/atomic.py); its manifest record {bytes, sha256}.
    `pickle_module`: deepspeed_pickle.PICKLE_MODULE for a file holding DeepSpeed's objects."""
    out = {}

    def save(f) -> None:
        writer = _HashingWriter(f)
        if pickle_module is None:
            torch.save(obj, writer)
        else:
            torch.save(obj, writer, pickle_module=pickle_module, pickle_protocol=2)
        out.update(bytes=writer.nbytes, sha256=writer.sha.hexdigest())

    atomic_write(path, save, buffering=buffering)
    return out


@dataclass
class WriteJob:
    """One rank's files of one save: (name, object) pairs written into `staging` in order."""

    staging: Path
    items: list[tuple[str, object]]
    io_buffer_bytes: int = 1 << 20
    records: dict[str, dict] = field(default_factory=dict)  # name -> {bytes, sha256} of each file written
    error: str | None = None
    seconds: float = 0.0
    nbytes: int = 0  # written
    snapshot_bytes: int = 0  # copied into host memory (asynchronous saves)
    pickle_modules: dict[str, object] = field(default_factory=dict)  # name -> pickle module (hashed_torch_save)

    def run(self) -> None:
        """Write every file (temporary name, fsync, rename: checkpoint/atomic.py), recording each; stop at
        the first failure with its description in `error`."""
        start = time.perf_counter()
        needed = sum(payload_bytes(obj) for _, obj in self.items)
        for name, obj in self.items:
            path = self.staging / name
            try:
                self.records[name] = hashed_torch_save(obj, path, self.io_buffer_bytes, self.pickle_modules.get(name))
            except Exception as exc:  # noqa: BLE001 — reported to every rank at the commit
                self.error = _describe_write_error(exc, path, needed)
                break
        self.items = []  # the snapshot's host memory goes as soon as it is on disk
        self.seconds = time.perf_counter() - start
        self.nbytes = sum(r["bytes"] for r in self.records.values())


class BackgroundWriter:
    """Runs one `WriteJob` at a time on a daemon thread (Note [no collectives off the training thread])."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._done.set()

    def start(self, job: WriteJob) -> None:
        if not self._done.is_set():
            raise RuntimeError("BackgroundWriter.start: the previous job is still being written (join it first)")
        self._done.clear()

        def run() -> None:
            try:
                job.run()
            except BaseException as exc:  # noqa: BLE001 — never leave the flag unset: the commit would wait forever
                job.error = job.error or f"checkpoint writer failed: {type(exc).__name__}: {exc}"
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name="zerospeed-checkpoint-writer", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
