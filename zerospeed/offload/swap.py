"""Swap files for NVMe offload: a checked directory, one file per (rank, kind), a pool of host buffers.

A ``SwapFile`` holds many tensors (optimizer states of every sub-group, parameter shards) at
4 KiB-aligned offsets of one file, so each tensor can move with O_DIRECT and the directory holds a
handful of files instead of thousands. Files carry the caller's name (which includes the rank), the
process id and a random token, so two jobs sharing a directory never collide; they are removed on
``close()``, when the owner is garbage collected, and at interpreter exit.
"""

from __future__ import annotations

import errno
import os
import pathlib
import secrets
import shutil
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Self

import torch

from zerospeed.offload.aio import (
    DIRECT_ALIGN,
    AsyncIO,
    IORequest,
    aligned_empty,
    round_up,
)
from zerospeed.utils.errors import ConfigError

# DeepSpeed's swap threshold (`deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES`, 1 MiB): its swappers keep
# smaller tensors in host memory. zerospeed's swap every tensor of an NVMe-offloaded state, whatever its size,
# so a tensor of at least this many bytes goes to NVMe under both (what DeepSpeed's tests size their models by).
MIN_SWAPPABLE_BYTES = 1024**2


def _human(nbytes: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def check_nvme_path(path: str | os.PathLike | None, needed_bytes: int, *, key: str) -> pathlib.Path:
    """Validate an NVMe offload directory before anything is written there; return it resolved.

    Raises ``ConfigError`` naming ``key`` and the fix when the path is unset, missing, not a directory,
    not writable by this process, or has less free space than ``needed_bytes``.
    """
    if path is None or not os.fspath(path).strip():
        raise ConfigError(
            f"{key} is not set: NVMe offload needs a directory on a fast local disk; "
            f'set "{key}": "/local_nvme" (any existing, writable directory)'
        )
    p = pathlib.Path(os.fspath(path)).expanduser()
    if not p.exists():
        parent_file = next((a for a in p.parents if a.is_file()), None)
        hint = f" ({parent_file} is a file, not a directory)" if parent_file else ""
        raise ConfigError(
            f"{key}={os.fspath(path)!r} does not exist{hint}: create it (mkdir -p) "
            f"or point {key} at an existing directory"
        )
    if not p.is_dir():
        raise ConfigError(
            f"{key}={os.fspath(path)!r} is not a directory: point {key} at a directory "
            "(swap files are created inside it)"
        )
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}={os.fspath(path)!r} is not writable by this process (uid {os.getuid()}): "
            f"fix its permissions (chmod/chown) or point {key} at a writable directory"
        )
    free = shutil.disk_usage(p).free
    if free < needed_bytes:
        raise ConfigError(
            f"{key}={os.fspath(path)!r} has {_human(free)} free ({free} bytes) but NVMe offload "
            f"needs {_human(needed_bytes)} ({needed_bytes} bytes): free space there, point {key} "
            "at a larger disk, or offload less (e.g. offload_optimizer only, or more ranks)"
        )
    return p.resolve()


def slot_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes a tensor of ``numel`` x ``dtype`` occupies in a swap file: its size rounded up to 4 KiB."""
    return round_up(numel * torch.empty((), dtype=dtype).element_size(), DIRECT_ALIGN)


@dataclass(frozen=True)
class _Slot:
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _remove(path: str) -> None:
    """Finalizer: delete the swap file if it is still there (never raises — it runs at exit / in GC)."""
    try:
        os.unlink(path)
    except OSError:
        pass


class SwapFile:
    """One file per (rank, kind) holding many tensors at aligned offsets; removed on close/exit.

    Usage: ``reserve`` every key, ``allocate`` (or let the first ``write`` do it), then ``write`` /
    ``read`` asynchronously and ``wait()`` on the returned requests. Reserving after ``allocate``
    grows the file. Reads and writes of the same key must be ordered by the caller (wait on the write
    before reading it back).
    """

    def __init__(self, directory: pathlib.Path, name: str, aio: AsyncIO) -> None:
        self._aio = aio
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._path = pathlib.Path(directory) / f"zerospeed-{name}-{token}.swp"
        self._slots: dict[Hashable, _Slot] = {}
        self.bytes_read = 0  # requested by read / read_run since creation (for benchmarks and tests)
        self._nbytes = 0
        self._file_size: int | None = None  # None until allocate() created the file
        self._pending: list[IORequest] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove, str(self._path))  # GC and interpreter exit

    @property
    def path(self) -> pathlib.Path:
        return self._path

    @property
    def nbytes(self) -> int:
        """Total reserved bytes (slots rounded up to 4 KiB) = the file size after ``allocate``."""
        return self._nbytes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def reserve(self, key: Hashable, numel: int, dtype: torch.dtype) -> None:
        """Give ``key`` an aligned slot for ``numel`` elements of ``dtype``; reserving the same key again
        with the same shape is a no-op, with a different one an error."""
        self._check_open()
        old = self._slots.get(key)
        if old is not None:
            if (old.numel, old.dtype) != (numel, dtype):
                raise ValueError(
                    f"SwapFile {self._path.name}: key {key!r} is already reserved as "
                    f"{old.numel} x {old.dtype}, not {numel} x {dtype}"
                )
            return
        if numel < 0:
            raise ValueError(f"SwapFile {self._path.name}: key {key!r}: numel must be >= 0, got {numel}")
        self._slots[key] = _Slot(self._nbytes, numel, dtype)
        self._nbytes += slot_nbytes(numel, dtype)
        if self._file_size is not None:
            self.allocate()

    def slot_bytes(self, key: Hashable) -> int:
        """Data bytes of ``key``'s tensor (numel x element size; the slot itself is rounded up to 4 KiB)."""
        return self._slot(key).nbytes

    def slot_offset(self, key: Hashable) -> int:
        """Byte offset of ``key``'s slot in the file (a multiple of 4 KiB)."""
        return self._slot(key).offset

    def allocate(self) -> None:
        """Create the file at its full reserved size, so a full disk fails now rather than mid-training."""
        self._check_open()
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if self._nbytes > (self._file_size or 0):
                try:
                    os.posix_fallocate(fd, 0, self._nbytes)
                except OSError as err:
                    if err.errno == errno.ENOSPC:
                        raise OSError(
                            errno.ENOSPC,
                            f"no space to allocate {self._nbytes} bytes for swap file "
                            f"{self._path}; free space or use another nvme_path",
                        ) from err
                    os.ftruncate(fd, self._nbytes)  # filesystems without fallocate: a sparse file
        finally:
            os.close(fd)
        self._file_size = self._nbytes
        self._aio.direct_for(self._path)  # probe now, so aio.direct is meaningful from here on

    def write(self, key: Hashable, tensor: torch.Tensor) -> IORequest:
        """Start writing ``tensor`` (numel and dtype of ``key``'s slot) to its slot; returns the request."""
        slot = self._checked(key, tensor, "write")
        if self._file_size is None or self._file_size < self._nbytes:
            self.allocate()
        return self._track(self._aio.write(tensor, self._path, slot.offset))

    def run_nbytes(self, keys: list) -> int | None:
        """Bytes of the slots of ``keys`` if they are consecutive in the file (one byte range), else None."""
        slots = [self._slot(k) for k in keys]
        for a, b in zip(slots, slots[1:]):
            if b.offset != a.offset + slot_nbytes(a.numel, a.dtype):
                return None
        return sum(slot_nbytes(sl.numel, sl.dtype) for sl in slots) if slots else None

    def write_run(self, keys: list, tensor: torch.Tensor) -> IORequest:
        """Write consecutive slots as ONE request: ``tensor`` holds each key's values at its slot's
        4 KiB-aligned position (padding included), i.e. exactly ``run_nbytes(keys)`` bytes."""
        offset = self._run(keys, tensor, "write_run")
        if self._file_size is None or self._file_size < self._nbytes:
            self.allocate()
        return self._track(self._aio.write(tensor, self._path, offset))

    def read_run(self, keys: list, out: torch.Tensor) -> IORequest:
        """Read consecutive slots as ONE request into ``out`` (the layout of `write_run`)."""
        offset = self._run(keys, out, "read_run")
        self.bytes_read += out.nbytes
        return self._track(self._aio.read(out, self._path, offset))

    def _run(self, keys: list, tensor: torch.Tensor, op: str) -> int:
        self._check_open()
        nbytes = self.run_nbytes(keys)
        if nbytes is None:
            raise ValueError(f"SwapFile {self._path.name}.{op}: the slots of {keys[:3]}... are not consecutive")
        if tensor.numel() * tensor.element_size() != nbytes:
            raise ValueError(
                f"SwapFile {self._path.name}.{op}: the tensor has "
                f"{tensor.numel() * tensor.element_size()} bytes, the slots {nbytes}"
            )
        return self._slot(keys[0]).offset

    def read(self, key: Hashable, out: torch.Tensor) -> IORequest:
        """Start reading ``key``'s slot into ``out`` (numel and dtype of the slot); returns the request."""
        slot = self._checked(key, out, "read")
        self.bytes_read += out.nbytes
        return self._track(self._aio.read(out, self._path, slot.offset))

    def close(self) -> None:
        """Wait for this file's outstanding requests (their errors stay with their ``wait()``) and delete it."""
        with self._lock:
            pending, self._pending = self._pending, []
        for req in pending:
            req._wait_quietly()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapFile({str(self._path)!r}, {len(self._slots)} slots, {self._nbytes} bytes)"

    # -- helpers ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"SwapFile {self._path} is closed")

    def _slot(self, key: Hashable) -> _Slot:
        try:
            return self._slots[key]
        except KeyError:
            raise KeyError(
                f"SwapFile {self._path.name}: no slot reserved for key {key!r}; call reserve() first"
            ) from None

    def _checked(self, key: Hashable, tensor: torch.Tensor, op: str) -> _Slot:
        self._check_open()
        slot = self._slot(key)
        if tensor.dtype != slot.dtype or tensor.numel() != slot.numel:
            raise ValueError(
                f"SwapFile.{op}({key!r}): tensor is {tensor.numel()} x {tensor.dtype}, "
                f"the slot holds {slot.numel} x {slot.dtype}"
            )
        return slot

    def _track(self, req: IORequest) -> IORequest:
        with self._lock:
            self._pending = [r for r in self._pending if not r.done()]
            self._pending.append(req)
        return req


class BufferPool:
    """A fixed pool of `count` aligned host buffers of `numel` elements (pinned with CUDA).

    The buffers stage tensors between the device and swap files; they are aligned so O_DIRECT moves
    them without a bounce copy. ``size_key`` / ``count_key`` name the config keys to raise in errors.
    """

    def __init__(
        self,
        count: int,
        numel: int,
        dtype: torch.dtype,
        *,
        pin: bool = False,
        size_key: str = "zero_optimization.offload_param.buffer_size",
        count_key: str = "zero_optimization.offload_param.buffer_count",
    ) -> None:
        if count < 1 or numel < 1:
            raise ConfigError(
                f"BufferPool needs count >= 1 ({count_key}) and numel >= 1 ({size_key}); "
                f"got count={count}, numel={numel}"
            )
        self.count, self.numel, self.dtype = count, numel, dtype
        self.size_key, self.count_key = size_key, count_key
        self._buffers = [aligned_empty(numel, dtype, pin=pin) for _ in range(count)]
        self._free = list(range(count))
        self._by_ptr = {b.data_ptr(): i for i, b in enumerate(self._buffers)}
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Bytes of buffer space (count x numel x element size; alignment slack not counted)."""
        return self.count * self.numel * self._buffers[0].element_size()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, numel: int, *, block: bool = False, timeout: float | None = None) -> torch.Tensor:
        """A 1-D view of ``numel`` elements at the start of a free buffer.

        Raises ``ConfigError`` naming ``size_key`` if ``numel`` exceeds the buffer size. With no buffer
        free: raises ``RuntimeError`` naming ``count_key`` (default), or with ``block=True`` waits for a
        ``release`` (up to ``timeout`` seconds, then raises).
        """
        if numel > self.numel:
            raise ConfigError(
                f"a tensor of {numel} elements does not fit the NVMe swap buffers of {self.numel} "
                f"elements: raise {self.size_key} to at least {numel}"
            )
        with self._cond:
            if not self._free and block:
                self._cond.wait_for(lambda: bool(self._free), timeout)
            if not self._free:
                raise RuntimeError(
                    f"all {self.count} swap buffers are in use: release one first, or raise "
                    f"{self.count_key} (now {self.count})"
                )
            index = self._free.pop()
        return self._buffers[index][:numel]

    def release(self, tensor: torch.Tensor) -> None:
        """Return a view obtained from ``acquire`` to the pool."""
        index = self._by_ptr.get(tensor.data_ptr())
        if index is None:
            raise ValueError("BufferPool.release: this tensor was not acquired from this pool")
        with self._cond:
            if index in self._free:
                raise ValueError(f"BufferPool.release: buffer {index} is already free (released twice?)")
            self._free.append(index)
            self._cond.notify()
