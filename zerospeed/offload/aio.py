"""Asynchronous file I/O for NVMe offload, in pure Python: no libaio, no compiled op.

A request (one tensor to or from one file range) is cut into ``block_size`` pieces that a thread pool
issues with ``os.pwrite`` / ``os.preadv`` straight from / into the tensor's memory (a memoryview over
the tensor's address — no staging copy). CPython releases the GIL inside both syscalls, so up to
``thread_count * queue_depth`` pieces are in flight at once, which is what keeps an NVMe queue full.

Where the filesystem allows it, pieces go through ``O_DIRECT`` (no page cache: no double buffering of
hundreds of GB of optimizer state, and reads really come from the device). ``O_DIRECT`` needs the
buffer address, the file offset and the length aligned to ``DIRECT_ALIGN`` bytes; allocate buffers
with ``aligned_empty``. A piece that is not aligned (an odd-sized tail, a tensor at an odd address)
falls back to buffered I/O for that piece only. See Note [direct and buffered pieces].
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import torch

from zerospeed.accelerator import get_accelerator

logger = logging.getLogger(__name__)

DIRECT_ALIGN = 4096
"""Alignment (bytes) of address, offset and length for O_DIRECT: the page size, which is a multiple of
every logical block size in use (512 B / 4 KiB), so it works on any device."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 on macOS / Windows: direct I/O is then never used


def round_up(n: int, alignment: int = DIRECT_ALIGN) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def aligned_empty(numel: int, dtype: torch.dtype, alignment: int = DIRECT_ALIGN, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D host tensor whose first byte sits at a multiple of ``alignment``.

    Over-allocates a uint8 buffer by ``alignment`` bytes and slices it at the first aligned address,
    so O_DIRECT can read into / write from it. ``pin=True`` page-locks it when the accelerator is CUDA
    (faster, asynchronous host<->device copies); on CPU pinning would buy nothing and is skipped.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    do_pin = pin and get_accelerator().name == "cuda"
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=do_pin)
    start = (-raw.data_ptr()) % alignment
    return raw[start : start + nbytes].view(dtype)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, sharing its memory (any dtype, bf16 too)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _check_tensor(tensor: torch.Tensor, op: str) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"AsyncIO.{op}: the tensor is on {tensor.device}; file I/O needs a host tensor "
            "(copy it into a host buffer, e.g. from BufferPool.acquire, first)"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"AsyncIO.{op}: the tensor is not contiguous; pass tensor.contiguous() or a flat buffer")


class AsyncIOError(OSError):
    """An I/O piece failed; the message names the operation, file, offset and length."""


# --------------------------------------------------------------------------------------------------
# Probing O_DIRECT, once per directory

_probe_lock = threading.Lock()
_direct_support: dict[str, bool] = {}


def probe_direct(directory: str | os.PathLike) -> bool:
    """Whether files in ``directory`` accept O_DIRECT: open a scratch file with it and write one aligned page.

    tmpfs refuses the open (EINVAL), some overlay/network filesystems refuse the write. The answer is
    cached per directory; the first "no" logs one warning.
    """
    key = os.path.realpath(directory)
    if not os.path.isdir(key):
        return False  # nothing to cache: opening a file there fails anyway, with its own error
    with _probe_lock:
        if key not in _direct_support:
            ok, why = _try_direct_write(key)
            _direct_support[key] = ok
            if not ok:
                logger.warning(
                    "O_DIRECT is not supported in %s (%s); NVMe swap there uses buffered I/O, "
                    "so data also passes through the page cache",
                    key,
                    why,
                )
        return _direct_support[key]


def _try_direct_write(directory: str) -> tuple[bool, str]:
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"
    try:
        fd, scratch = tempfile.mkstemp(prefix=".zerospeed-odirect-probe-", dir=directory)
    except OSError as err:
        return False, f"cannot create a probe file: {err}"
    try:
        os.close(fd)
        fd = os.open(scratch, os.O_WRONLY | _O_DIRECT)
        try:
            page = aligned_empty(DIRECT_ALIGN, torch.uint8).zero_()
            os.pwrite(fd, _byte_view(page), 0)
        finally:
            os.close(fd)
        return True, ""
    except OSError as err:
        return False, f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror}"
    finally:
        try:
            os.unlink(scratch)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class _Piece:
    """``length`` bytes at ``start`` of the tensor's bytes <-> file offset ``file_offset``."""

    start: int
    length: int
    file_offset: int
    direct: bool


def plan_pieces(nbytes: int, address: int, offset: int, block_size: int, direct: bool) -> list[_Piece]:
    """Cut a transfer of ``nbytes`` (memory at ``address``, file at ``offset``) into pieces.

    Note [direct and buffered pieces]: with direct I/O, block boundaries fall every ``block_size``
    (rounded up to DIRECT_ALIGN) bytes. If address and offset are both aligned, every piece but the
    last is aligned, and the last is split into its aligned head (direct) and a sub-page tail
    (buffered). If either is misaligned, every piece is buffered. The tail's page is never touched by
    a direct piece, so page cache and direct I/O never overlap within one request.
    """
    if nbytes <= 0:
        return []
    aligned = direct and address % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0
    step = round_up(block_size) if aligned else block_size
    pieces = []
    for start in range(0, nbytes, step):
        length = min(step, nbytes - start)
        head = length - length % DIRECT_ALIGN if aligned else 0
        if head:
            pieces.append(_Piece(start, head, offset + start, True))
        if length > head:
            pieces.append(_Piece(start + head, length - head, offset + start + head, False))
    return pieces


class IORequest:
    """One asynchronous read or write. ``wait()`` blocks until every piece finished and re-raises the
    failure (the one at the lowest offset) as ``AsyncIOError`` naming the file and offset."""

    def __init__(
        self, op: str, path: str, offset: int, nbytes: int, tensor: torch.Tensor | None, pieces: int, fds: list[int]
    ) -> None:
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self._tensor = tensor  # keeps the memory the pieces point into alive until the last one ends
        self._fds = fds
        self._remaining = pieces
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._error_offset = -1
        if pieces == 0:
            self._finish()

    @classmethod
    def failed(cls, op: str, path: str, offset: int, nbytes: int, error: BaseException) -> IORequest:
        """A request that failed before any piece was issued (e.g. the file could not be opened)."""
        req = cls(op, path, offset, nbytes, None, 0, [])
        req._error = error
        return req

    def _piece_done(self, error: BaseException | None, offset: int = 0) -> None:
        with self._lock:
            # the failure at the lowest offset wins, so the report does not depend on thread timing
            if error is not None and (self._error is None or offset < self._error_offset):
                self._error, self._error_offset = error, offset
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed under us (the failure is what wait() reports)
        self._fds = []
        self._tensor = None
        self._event.set()

    def done(self) -> bool:
        """True once every piece has finished (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self) -> None:
        """Block until the request finished; raise ``AsyncIOError`` (path and offset in the message) on failure."""
        self._event.wait()
        if self._error is not None:
            raise self._error

    def _wait_quietly(self) -> None:
        self._event.wait()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self.done() else "pending")
        return f"IORequest({self.op} {self.nbytes} B at {self.offset} of {self.path!r}, {state})"


def _write_piece(fd: int, view: memoryview, piece: _Piece) -> None:
    """pwrite the piece, looping over short writes (a signal or a full pipe can cut a write short)."""
    done = 0
    while done < piece.length:
        chunk = view[piece.start + done : piece.start + piece.length]
        n = os.pwrite(fd, chunk, piece.file_offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote 0 bytes")
        done += n


def _read_piece(fd: int, view: memoryview, piece: _Piece) -> None:
    """preadv the piece into the tensor's memory; end of file before ``length`` bytes is an error.

    A regular file returns fewer bytes than asked only at its end (and a retry of an O_DIRECT read at
    that unaligned point would fail with EINVAL), so a short read is reported as end of file.
    """
    n = os.preadv(fd, [view[piece.start : piece.start + piece.length]], piece.file_offset)
    if n < piece.length:
        raise OSError(
            errno.EIO,
            f"unexpected end of file after {piece.file_offset + n} bytes (the file is shorter than the data asked for)",
        )


@dataclass(frozen=True)
class AioPlan:
    """The `aio` section, resolved once (the engine's plans): `AsyncIO`'s settings, under its names."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    """`aio.thread_count` and `aio.intra_op_parallelism` are two names for this knob: the larger wins."""
    single_submit: bool = False
    overlap_events: bool = True


class AsyncIO:
    """A pool of I/O threads moving contiguous host tensors to and from files, asynchronously.

    - ``block_size``: bytes per piece (one syscall); rounded up to 4 KiB when direct I/O is used.
    - ``queue_depth`` x ``thread_count``: worker threads, i.e. pieces in flight at once.
    - ``single_submit=True``: a request's pieces are issued one at a time, in order, by a single
      worker (at most one piece of that request in flight); concurrency then only comes from several
      outstanding requests. ``False`` (default): all pieces of a request are queued at once and the
      pool runs up to its size of them concurrently.
    - ``overlap_events=True`` (default): ``read``/``write`` submit at once, even while earlier requests
      are in flight. ``False``: each ``read``/``write`` first waits for every earlier request of this
      AsyncIO to finish (their errors are still raised by their own ``wait()``), so requests run
      strictly one after another.
    - ``use_direct``: ``None`` (default) uses O_DIRECT where the directory supports it (probed once)
      and buffered I/O elsewhere, with one warning; ``False`` always buffered; ``True`` requires
      O_DIRECT and raises ``AsyncIOError`` on a filesystem without it.

    ``direct`` is True while direct I/O is enabled and every directory used so far supports it.
    """

    def __init__(
        self,
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        thread_count: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        use_direct: bool | None = None,
    ) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth), ("thread_count", thread_count)):
            if value < 1:
                raise ValueError(f"AsyncIO: {name} must be >= 1 (aio.{name}), got {value}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self.use_direct = use_direct
        self.direct: bool = use_direct is not False and bool(_O_DIRECT)
        self._pool = ThreadPoolExecutor(max_workers=thread_count * queue_depth, thread_name_prefix="zerospeed-aio")
        self._pending: list[IORequest] = []
        self._lock = threading.Lock()
        self._closed = False
        self._direct_paths: dict[str, bool] = {}  # path -> O_DIRECT there (see direct_for)

    @classmethod
    def from_plan(cls, plan: AioPlan, *, use_direct: bool | None = None) -> AsyncIO:
        """An engine with the settings of `plan` (the resolved `aio` section)."""
        return cls(
            block_size=plan.block_size,
            queue_depth=plan.queue_depth,
            thread_count=plan.thread_count,
            single_submit=plan.single_submit,
            overlap_events=plan.overlap_events,
            use_direct=use_direct,
        )

    # -- public API ---------------------------------------------------------------------------------

    def direct_for(self, path: str | os.PathLike) -> bool:
        """Whether I/O to ``path`` (a file or a directory) uses O_DIRECT; probes the directory once."""
        if self.use_direct is False or not _O_DIRECT:
            return False
        key = os.fspath(path)
        cached = self._direct_paths.get(key)
        if cached is not None:  # a swap file sees thousands of requests: probe (realpath, isdir) once
            return cached
        directory = path if os.path.isdir(path) else (os.path.dirname(key) or ".")
        ok = probe_direct(directory)
        if not ok:
            self.direct = False
            if self.use_direct:
                raise AsyncIOError(
                    errno.EINVAL,
                    f"use_direct=True but {os.path.realpath(directory)} does not "
                    "support O_DIRECT; use a local disk (ext4/xfs) or use_direct=None",
                )
        if os.path.isdir(directory):
            self._direct_paths[key] = ok
        return ok

    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IORequest:
        """Write the tensor's bytes to ``path`` at byte ``offset`` (file created if missing, never truncated)."""
        _check_tensor(tensor, "write")
        return self._submit("write", tensor, os.fspath(path), offset, os.O_WRONLY | os.O_CREAT, _write_piece)

    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IORequest:
        """Fill the tensor with ``tensor.nbytes`` bytes of ``path`` starting at byte ``offset``."""
        _check_tensor(tensor, "read")
        return self._submit("read", tensor, os.fspath(path), offset, os.O_RDONLY, _read_piece)

    def wait_all(self) -> None:
        """Wait for every outstanding request; raise the first failure among them."""
        with self._lock:
            pending, self._pending = self._pending, []
        for req in pending:
            req._wait_quietly()
        for req in pending:
            req.wait()

    def close(self) -> None:
        """Wait for outstanding requests (errors are left to their ``wait()``) and stop the threads."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending, self._pending = self._pending, []
        for req in pending:
            req._wait_quietly()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission ---------------------------------------------------------------------------------

    def _submit(
        self,
        op: str,
        tensor: torch.Tensor,
        path: str,
        offset: int,
        flags: int,
        io: Callable[[int, memoryview, _Piece], None],
    ) -> IORequest:
        if self._closed:
            raise RuntimeError(f"AsyncIO.{op}({path!r}): this AsyncIO is closed")
        if offset < 0:
            raise ValueError(f"AsyncIO.{op}({path!r}): offset must be >= 0, got {offset}")
        if not self.overlap_events:
            self._drain()
        nbytes = tensor.numel() * tensor.element_size()
        try:
            direct = self.direct_for(path) if nbytes else False
            pieces = plan_pieces(nbytes, tensor.data_ptr(), offset, self.block_size, direct)
            fds = self._open(path, flags, pieces)
        except OSError as err:
            return IORequest.failed(op, path, offset, nbytes, _describe(op, path, offset, nbytes, err))
        view = _byte_view(tensor)
        req = IORequest(
            op,
            path,
            offset,
            nbytes,
            tensor,
            len(pieces) if not self.single_submit else min(1, len(pieces)),
            list(fds.values()),
        )
        if self.single_submit and pieces:
            self._pool.submit(self._run_sequence, req, io, fds, view, pieces)
        else:
            for piece in pieces:
                self._pool.submit(self._run_piece, req, io, fds[piece.direct], view, piece)
        with self._lock:
            self._pending = [r for r in self._pending if not r.done()]
            self._pending.append(req)
        return req

    def _drain(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for req in pending:
            req._wait_quietly()

    @staticmethod
    def _open(path: str, flags: int, pieces: list[_Piece]) -> dict[bool, int]:
        """One descriptor per kind of piece in the request: {True: O_DIRECT fd, False: buffered fd}."""
        fds: dict[bool, int] = {}
        try:
            for direct in sorted({p.direct for p in pieces}):
                fds[direct] = os.open(path, flags | (_O_DIRECT if direct else 0), 0o600)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    @staticmethod
    def _run_piece(req: IORequest, io: Callable, fd: int, view: memoryview, piece: _Piece) -> None:
        error = None
        try:
            io(fd, view, piece)
        except BaseException as err:  # noqa: BLE001 - every failure must reach wait(), not die in the pool
            error = _describe(req.op, req.path, piece.file_offset, piece.length, err, direct=piece.direct)
        req._piece_done(error, piece.file_offset)

    @staticmethod
    def _run_sequence(
        req: IORequest, io: Callable, fds: dict[bool, int], view: memoryview, pieces: list[_Piece]
    ) -> None:
        error = None
        for piece in pieces:
            try:
                io(fds[piece.direct], view, piece)
            except BaseException as err:  # noqa: BLE001
                error = _describe(req.op, req.path, piece.file_offset, piece.length, err, direct=piece.direct)
                break
        req._piece_done(error)


def _describe(
    op: str, path: str, offset: int, nbytes: int, err: BaseException, *, direct: bool = False
) -> AsyncIOError:
    """Wrap a low-level failure so the message says what was being done where."""
    code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
    mode = " (O_DIRECT)" if direct else ""
    why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    wrapped = AsyncIOError(code, f"async {op}{mode} of {nbytes} bytes at offset {offset} of {path!r} failed: {why}")
    wrapped.__cause__ = err
    return wrapped
