"""NVMe offload I/O without processes: AsyncIO round trips (O_DIRECT and buffered), piece planning,
swap-file layout and cleanup, the nvme_path checks, buffer pools and injected I/O errors."""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from zerospeed.config import ConfigError
from zerospeed.config.schema.offload import AioConfig
from zerospeed.offload import (
    AsyncIO,
    AsyncIOError,
    BufferPool,
    SwapFile,
    aligned_empty,
    check_nvme_path,
    probe_direct,
    slot_nbytes,
)
from zerospeed.offload import aio as aio_mod
from zerospeed.runtime.plans import aio_plan

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64]
ODD_SIZES = [1, 7, 1023, 4097, 65_537, 300_001]


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


@pytest.fixture
def spy_pwrite(monkeypatch, tmp_path):
    """Record, for every pwrite, whether its descriptor had O_DIRECT set (the O_DIRECT probe of
    tmp_path runs first, so its own write is not counted)."""
    probe_direct(tmp_path)
    seen: list[bool] = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        seen.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return seen


def _no_direct_here(monkeypatch):
    """Make every O_DIRECT open fail with EINVAL, as tmpfs does on kernels before 6.6."""
    real = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


# ----------------------------------------------------------------------------------------------------
# Pure pieces


def test_plan_pieces_splits_aligned_blocks_and_a_buffered_tail():
    plan = aio_mod.plan_pieces(10_000, address=8192, offset=4096, block_size=4096, direct=True)
    assert [(p.start, p.length, p.file_offset, p.direct) for p in plan] == [
        (0, 4096, 4096, True),
        (4096, 4096, 8192, True),
        (8192, 1808, 12288, False),
    ]
    # block_size not a page multiple is rounded up for direct I/O; a sub-page request is all tail
    plan = aio_mod.plan_pieces(9000, address=0, offset=0, block_size=5000, direct=True)
    assert [(p.start, p.length, p.direct) for p in plan] == [(0, 8192, True), (8192, 808, False)]
    assert [(p.length, p.direct) for p in aio_mod.plan_pieces(100, 0, 0, 1 << 20, True)] == [(100, False)]


def test_plan_pieces_misaligned_or_buffered_is_never_direct():
    for address, offset, direct in [(8, 0, True), (0, 512, True), (0, 0, False)]:
        plan = aio_mod.plan_pieces(10_000, address, offset, 3000, direct)
        assert [(p.start, p.length) for p in plan] == [(0, 3000), (3000, 3000), (6000, 3000), (9000, 1000)]
        assert not any(p.direct for p in plan)
    assert aio_mod.plan_pieces(0, 0, 0, 4096, True) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 4097, 100_003])
def test_aligned_empty_is_aligned_and_sized(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    if numel:
        assert t.data_ptr() % 4096 == 0
    assert aligned_empty(numel, dtype, alignment=64 * 1024).data_ptr() % (64 * 1024) == 0 or numel == 0


def test_slot_nbytes_rounds_to_pages():
    assert slot_nbytes(1, torch.float32) == 4096
    assert slot_nbytes(1024, torch.float32) == 4096
    assert slot_nbytes(1025, torch.float32) == 8192
    assert slot_nbytes(0, torch.float16) == 0


def test_from_config_takes_the_larger_thread_knob():
    cfg = AioConfig(
        block_size=262_144,
        queue_depth=4,
        thread_count=2,
        intra_op_parallelism=3,
        single_submit=True,
        overlap_events=False,
    )
    with AsyncIO.from_plan(aio_plan(cfg)) as aio:
        assert (aio.block_size, aio.queue_depth, aio.thread_count) == (262_144, 4, 3)
        assert aio.single_submit and not aio.overlap_events
        assert aio._pool._max_workers == 12


# ----------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("use_direct", [None, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("single_submit,overlap_events", [(False, True), (True, True), (False, False)])
def test_swapfile_round_trip_many_keys_concurrently(tmp_path, spy_pwrite, use_direct, single_submit, overlap_events):
    with AsyncIO(
        block_size=64 * 1024,
        queue_depth=4,
        thread_count=2,
        use_direct=use_direct,
        single_submit=single_submit,
        overlap_events=overlap_events,
    ) as aio:
        swap = SwapFile(tmp_path, "rank0-optimizer", aio)
        tensors = {}
        for i, (numel, dtype) in enumerate((n, d) for n in ODD_SIZES for d in DTYPES[:4]):
            key = ("group", i)
            swap.reserve(key, numel, dtype)
            tensors[key] = _random(numel, dtype, seed=i)
        swap.allocate()
        assert swap.path.stat().st_size == swap.nbytes == sum(slot_nbytes(t.numel(), t.dtype) for t in tensors.values())
        # write from aligned buffers and from plain tensors alike, all requests in flight together
        sources = {
            k: (aligned_empty(t.numel(), t.dtype).copy_(t) if i % 2 else t) for i, (k, t) in enumerate(tensors.items())
        }
        for req in [swap.write(k, t) for k, t in sources.items()]:
            req.wait()
        outs = {k: aligned_empty(t.numel(), t.dtype).fill_(0) for k, t in tensors.items()}
        reqs = [swap.read(k, outs[k]) for k in tensors]
        for req in reqs:
            req.wait()
            assert req.done()
        for k, t in tensors.items():
            assert torch.equal(outs[k], t), k
        swap.close()
    flags = list(spy_pwrite)
    assert probe_direct(tmp_path)  # /tmp is ext4 here; the test documents the direct path really ran
    if use_direct is None:
        assert aio.direct and any(flags) and not all(flags)  # aligned blocks direct, tails buffered
    else:
        assert not aio.direct and not any(flags)


def test_unaligned_tensor_and_offset_fall_back_to_buffered_pieces(tmp_path, spy_pwrite):
    base = _random(50_000, torch.float32, seed=1)
    odd = base[3:]  # address 12 bytes past an allocation boundary
    path = tmp_path / "raw.bin"
    with AsyncIO(block_size=8192) as aio:
        aio.write(odd, path, offset=100).wait()
        out = torch.empty_like(odd)
        aio.read(out, path, offset=100).wait()
    assert torch.equal(out, odd)
    assert spy_pwrite and not any(spy_pwrite)
    assert path.read_bytes()[:100] == bytes(100)  # the gap before the offset is a hole of zeros


def test_without_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, spy_pwrite):
    _no_direct_here(monkeypatch)
    tmp_path = tmp_path / "no_direct"  # not probed yet (the spy probed its parent)
    tmp_path.mkdir()
    t = _random(70_001, torch.float32, seed=2)
    with caplog.at_level(logging.WARNING, logger="zerospeed.offload.aio"):
        for _ in range(2):  # a second AsyncIO in the same directory reuses the probe: no second warning
            with AsyncIO() as aio:
                swap = SwapFile(tmp_path, "rank1-param", aio)
                swap.reserve("w", t.numel(), t.dtype)
                swap.write("w", aligned_empty(t.numel(), t.dtype).copy_(t)).wait()
                out = aligned_empty(t.numel(), t.dtype)
                swap.read("w", out).wait()
                assert torch.equal(out, t) and not aio.direct
                swap.close()
    warnings = [r for r in caplog.records if "O_DIRECT is not supported" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].getMessage()
    assert not any(spy_pwrite)


def test_use_direct_true_on_a_filesystem_without_it_fails_in_wait(tmp_path, monkeypatch):
    _no_direct_here(monkeypatch)
    with AsyncIO(use_direct=True) as aio:
        req = aio.write(aligned_empty(4096, torch.uint8), tmp_path / "x.bin")
        with pytest.raises(AsyncIOError, match="does not support O_DIRECT"):
            req.wait()


def test_single_submit_keeps_one_piece_in_flight_per_request(tmp_path, monkeypatch):
    active, peak, lock = [0], [0], threading.Lock()
    real = os.pwrite

    def slow_pwrite(fd, data, offset):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    t = aligned_empty(16 * 4096, torch.uint8).fill_(3)
    for single, expected in [(True, 1), (False, 8)]:
        peak[0] = 0
        with AsyncIO(block_size=4096, queue_depth=8, single_submit=single) as aio:
            aio.write(t, tmp_path / f"s{single}.bin").wait()
        assert peak[0] == expected if single else peak[0] > 1


def test_overlap_events_false_finishes_earlier_requests_before_submitting(tmp_path):
    t = aligned_empty(1 << 20, torch.uint8).fill_(7)
    with AsyncIO(block_size=4096, queue_depth=2, overlap_events=False) as aio:
        first = aio.write(t, tmp_path / "a.bin")
        second = aio.write(t, tmp_path / "b.bin")
        assert first.done()
        second.wait()
    assert (tmp_path / "a.bin").read_bytes() == bytes([7]) * (1 << 20)


# ----------------------------------------------------------------------------------------------------
# Swap-file layout, names and cleanup


def test_slots_are_aligned_disjoint_and_file_grows_on_late_reserve(tmp_path):
    with AsyncIO() as aio:
        swap = SwapFile(tmp_path, "rank3-optimizer", aio)
        sizes = [(5, torch.float32), (4096, torch.bfloat16), (1, torch.int8), (2048, torch.float16), (0, torch.float32)]
        for i, (n, d) in enumerate(sizes):
            swap.reserve(i, n, d)
        swap.reserve(0, 5, torch.float32)  # same shape again: no-op
        offsets = [swap.slot_offset(i) for i in range(len(sizes))]
        assert offsets == [0, 4096, 12288, 16384, 20480]
        assert [swap.slot_bytes(i) for i in range(len(sizes))] == [20, 8192, 1, 4096, 0]
        assert swap.nbytes == 20480
        swap.allocate()
        assert swap.path.stat().st_size == 20480
        swap.reserve("late", 1000, torch.float64)
        assert swap.path.stat().st_size == swap.nbytes == 28672
        with pytest.raises(ValueError, match="already reserved"):
            swap.reserve(0, 6, torch.float32)
        with pytest.raises(ValueError, match="slot holds 5"):
            swap.write(0, torch.zeros(6))
        with pytest.raises(KeyError, match="reserve"):
            swap.read("missing", torch.zeros(1))
        swap.close()


def test_names_carry_rank_pid_and_a_unique_token(tmp_path):
    with AsyncIO() as aio:
        a, b = SwapFile(tmp_path, "rank0-param", aio), SwapFile(tmp_path, "rank0-param", aio)
        assert a.path != b.path
        assert "rank0-param" in a.path.name and str(os.getpid()) in a.path.name
        a.close(), b.close()


def test_file_removed_on_close_and_when_collected(tmp_path):
    with AsyncIO() as aio:
        swap = SwapFile(tmp_path, "rank0-optimizer", aio)
        swap.reserve("k", 10, torch.float32)
        swap.write("k", torch.ones(10)).wait()
        path = swap.path
        assert path.exists()
        swap.close()
        assert not path.exists() and swap.closed
        swap.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            swap.write("k", torch.ones(10))

        owner = SwapFile(tmp_path, "rank0-param", aio)
        owner.reserve("k", 10, torch.float32)
        owner.allocate()
        path = owner.path
        assert path.exists()
        del owner
        gc.collect()
        assert not path.exists()


def test_file_removed_at_interpreter_exit(tmp_path):
    code = (
        "import pathlib, sys, torch\n"
        "from zerospeed.offload import AsyncIO, SwapFile\n"
        "aio = AsyncIO()\n"
        f"swap = SwapFile(pathlib.Path({str(tmp_path)!r}), 'rank0-exit', aio)\n"
        "swap.reserve('k', 1000, torch.float32)\n"
        "swap.write('k', torch.ones(1000)).wait()\n"
        "print(swap.path)\n"
        "globals()['keep'] = swap  # still referenced at exit: only the exit hook can remove it\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    path = out.stdout.strip()
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------
# check_nvme_path

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_check_nvme_path_accepts_a_writable_directory(tmp_path):
    assert check_nvme_path(str(tmp_path / "."), 1 << 20, key=KEY) == tmp_path.resolve()


@pytest.mark.parametrize("value", [None, "", "   "])
def test_check_nvme_path_unset(value):
    with pytest.raises(ConfigError, match=rf"{KEY} is not set.*set \"{KEY}\""):
        check_nvme_path(value, 1, key=KEY)


def test_check_nvme_path_missing_and_under_a_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"{KEY}=.*nope' does not exist: create it"):
        check_nvme_path(tmp_path / "nope", 1, key=KEY)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"does not exist \(.*file is a file, not a directory\)"):
        check_nvme_path(tmp_path / "file" / "sub", 1, key=KEY)


def test_check_nvme_path_file_not_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=rf"{KEY}=.*file' is not a directory: point {KEY} at a directory"):
        check_nvme_path(tmp_path / "file", 1, key=KEY)


def test_check_nvme_path_not_writable(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: not (mode & os.W_OK))  # root bypasses chmod
    with pytest.raises(ConfigError, match=rf"is not writable by this process .*chmod/chown.* {KEY}"):
        check_nvme_path(tmp_path, 1, key=KEY)


def test_check_nvme_path_not_enough_space(tmp_path):
    with pytest.raises(
        ConfigError, match=r"free \(\d+ bytes\) but NVMe offload needs 1024.00 TiB \(1125899906842624 bytes\)"
    ):
        check_nvme_path(tmp_path, 1 << 50, key=KEY)


# ----------------------------------------------------------------------------------------------------
# Injected I/O errors surface in wait() with the path and the offset


def test_reading_a_deleted_swap_file_names_it(tmp_path):
    with AsyncIO() as aio:
        swap = SwapFile(tmp_path, "rank0-optimizer", aio)
        swap.reserve("a", 100, torch.float32)
        swap.reserve("b", 100, torch.float32)
        swap.write("b", torch.ones(100)).wait()
        os.unlink(swap.path)  # someone cleans the scratch dir mid-run
        req = swap.read("b", torch.empty(100))
        with pytest.raises(
            AsyncIOError, match=rf"async read of 400 bytes at offset 4096 of '{swap.path}'.*No such file"
        ) as info:
            req.wait()
        assert info.value.errno == errno.ENOENT
        swap.close()


def test_short_file_read_reports_end_of_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10_000))
    with AsyncIO(block_size=4096) as aio:
        req = aio.read(aligned_empty(4096, torch.float32), path)
        with pytest.raises(AsyncIOError, match=rf"of '{path}' failed: unexpected end of file after 10000 bytes"):
            req.wait()


def test_device_error_mid_write_surfaces_in_wait_with_offset(tmp_path, monkeypatch):
    probe_direct(tmp_path)  # its write is not one of the request's pieces
    real, calls = os.pwrite, [0]

    def failing_pwrite(fd, data, offset):
        calls[0] += 1
        if offset == 3 * 8192:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    path = tmp_path / "eio.bin"
    with AsyncIO(block_size=8192, queue_depth=2) as aio:
        req = aio.write(aligned_empty(6 * 8192, torch.uint8), path)  # submitting does not raise
        with pytest.raises(
            AsyncIOError,
            match=rf"async write \(O_DIRECT\) of 8192 bytes at offset 24576 of '{path}' failed: Input/output error",
        ) as info:
            req.wait()
        assert info.value.errno == errno.EIO and req.done()
        assert calls[0] == 6  # the other pieces still ran: no descriptor closed under a running piece
        aio.write(aligned_empty(8192, torch.uint8), path).wait()  # the pool survives a failed request


def test_host_tensor_required():
    with AsyncIO() as aio:
        with pytest.raises(ValueError, match="not contiguous"):
            aio.write(torch.zeros(4, 4).t(), "/tmp/unused")
        with pytest.raises(ValueError, match="is on meta"):
            aio.write(torch.zeros(4, device="meta"), "/tmp/unused")
    with pytest.raises(RuntimeError, match="closed"):
        aio.read(torch.zeros(4), "/tmp/unused")


# ----------------------------------------------------------------------------------------------------
# BufferPool


def test_buffer_pool_hands_out_aligned_views_and_names_the_keys():
    pool = BufferPool(
        2,
        1000,
        torch.float32,
        size_key="zero_optimization.offload_param.buffer_size",
        count_key="zero_optimization.offload_param.buffer_count",
    )
    assert pool.nbytes == 8000
    a, b = pool.acquire(1000), pool.acquire(10)
    assert a.numel() == 1000 and b.numel() == 10 and a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert a.data_ptr() != b.data_ptr()
    with pytest.raises(
        RuntimeError, match=r"all 2 swap buffers are in use.*raise zero_optimization.offload_param.buffer_count"
    ):
        pool.acquire(1)
    with pytest.raises(
        ConfigError, match=r"1001 elements.*raise zero_optimization.offload_param.buffer_size to at least 1001"
    ):
        pool.acquire(1001)
    pool.release(b)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b)
    with pytest.raises(ValueError, match="not acquired from this pool"):
        pool.release(torch.zeros(3))
    assert pool.free_count == 1


def test_buffer_pool_blocks_until_a_release():
    pool = BufferPool(1, 16, torch.float16)
    held = pool.acquire(16)
    threading.Timer(0.05, pool.release, args=(held,)).start()
    again = pool.acquire(8, block=True, timeout=10)
    assert again.data_ptr() == held.data_ptr()
    with pytest.raises(RuntimeError, match="in use"):
        pool.acquire(1, block=True, timeout=0.01)


def test_runs_of_consecutive_slots_move_as_one_request(tmp_path):
    sizes = [1000, 3000, 1]  # fp32 slots of 4 KiB, 12 KiB, 4 KiB
    with AsyncIO() as aio:
        swap = SwapFile(tmp_path, "run", aio)
        for k, n in enumerate(sizes):
            swap.reserve(k, n, torch.float32)
        swap.allocate()
        assert swap.run_nbytes([0, 1, 2]) == 5 * 4096 and swap.run_nbytes([0, 2]) is None
        padded = torch.zeros(5 * 1024)
        values = [_random(n, torch.float32, k) for k, n in enumerate(sizes)]
        for start, v in zip([0, 1024, 4096], values):
            padded[start : start + v.numel()] = v
        swap.write_run([0, 1, 2], padded).wait()
        for k, v in enumerate(values):  # each slot holds its own values
            out = torch.empty_like(v)
            swap.read(k, out).wait()
            assert torch.equal(out, v)
        back = torch.full((4 * 1024,), -1.0)
        swap.read_run([1, 2], back).wait()
        assert torch.equal(back[:3000], values[1]) and torch.equal(back[3072:3073], values[2])
        with pytest.raises(ValueError, match="not consecutive"):
            swap.read_run([0, 2], torch.empty(2 * 1024))
        with pytest.raises(ValueError, match="bytes, the slots"):
            swap.write_run([0, 1], torch.empty(10))
        swap.close()
