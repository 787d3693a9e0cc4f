"""NVMe swap bandwidth: zerospeed's pure-Python AsyncIO/SwapFile against fio, on one directory.

    python benchmarks/nvme_swap.py                          # 2 GB on a scratch dir under /work
    python benchmarks/nvme_swap.py --dir /local_nvme --gb 8 --block-size 1048576 --queue-depth 8
    python benchmarks/nvme_swap.py --sweep                  # also try block sizes x queue depths

For each mode (O_DIRECT, buffered) it writes ``--gb`` of fp32 tensors (``--tensor-mb`` each, cycled
from a few aligned host buffers so the benchmark needs little RAM) into one SwapFile, waits, fsyncs,
then reads them all back, and reports GB/s (1 GB = 1e9 bytes). Before every read the page cache is
dropped for the file (``posix_fadvise(DONTNEED)`` after ``fsync`` — this works without privileges,
unlike ``/proc/sys/vm/drop_caches``), so buffered reads come from the device too; O_DIRECT bypasses
the cache anyway. The last buffers read are compared with what was written.

If ``fio`` is on PATH it runs sequential write then read with ``direct=1``, ``bs = --block-size``,
``iodepth = --queue-depth`` (libaio) on the same directory and size; the table gives ours/fio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from zerospeed.offload import AsyncIO, SwapFile, aligned_empty, probe_direct

GB = 1e9


def machine_info(directory: pathlib.Path) -> list[str]:
    """nproc, CPU model, free space and filesystem type of the benchmark directory."""
    lines = [f"nproc: {os.cpu_count()}", f"python {platform.python_version()}, torch {torch.__version__}"]
    try:
        model = [
            ln
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
            if "Model name" in ln
        ]
        lines += [m.strip() for m in model]
    except OSError:
        pass
    try:
        df = subprocess.run(["df", "-hT", str(directory)], capture_output=True, text=True, check=False).stdout.strip()
        lines += df.splitlines()
    except OSError:
        pass
    lines.append(f"O_DIRECT supported in {directory}: {probe_direct(directory)}")
    return lines


def try_drop_caches() -> bool:
    """The global page-cache drop; usually refused in a container (then the per-file drop still works)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_file_cache(path: pathlib.Path) -> None:
    """Flush the file and evict its pages from the page cache (no privileges needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_ours(
    directory: pathlib.Path,
    total_bytes: int,
    tensor_bytes: int,
    *,
    block_size: int,
    queue_depth: int,
    thread_count: int,
    use_direct: bool | None,
    sources: list[torch.Tensor],
) -> dict:
    """Write then read ``total_bytes`` through one SwapFile; returns GB/s each way and whether O_DIRECT ran."""
    numel = tensor_bytes // 4
    count = max(1, total_bytes // tensor_bytes)
    with AsyncIO(
        block_size=block_size, queue_depth=queue_depth, thread_count=thread_count, use_direct=use_direct
    ) as aio:
        swap = SwapFile(directory, "rank0-bench", aio)
        for i in range(count):
            swap.reserve(i, numel, torch.float32)
        swap.allocate()
        drop_file_cache(swap.path)
        t0 = time.perf_counter()
        requests = [swap.write(i, sources[i % len(sources)]) for i in range(count)]
        for r in requests:
            r.wait()
        fd = os.open(swap.path, os.O_RDONLY)
        os.fsync(fd)  # buffered writes are only on the device after this; it is part of the cost
        os.close(fd)
        write_s = time.perf_counter() - t0
        drop_file_cache(swap.path)
        outs = [aligned_empty(numel, torch.float32) for _ in sources]
        t0 = time.perf_counter()
        requests = [swap.read(i, outs[i % len(outs)]) for i in range(count)]
        for r in requests:
            r.wait()
        read_s = time.perf_counter() - t0
        # the last len(outs) reads landed last in each buffer: check them against their sources
        for i in range(max(0, count - len(outs)), count):
            if not torch.equal(outs[i % len(outs)], sources[i % len(sources)]):
                raise RuntimeError(f"read-back mismatch in tensor {i}")
        direct = aio.direct
        swap.close()
    nbytes = count * numel * 4
    return {"write": nbytes / write_s / GB, "read": nbytes / read_s / GB, "direct": direct, "bytes": nbytes}


def run_fio(directory: pathlib.Path, total_bytes: int, block_size: int, queue_depth: int) -> dict | str:
    """fio sequential write then read with direct=1; GB/s each way, or why it did not run."""
    fio = shutil.which("fio")
    if fio is None:
        return "fio not found (apt-get install -y fio)"
    result = {}
    name = f"zerospeed-fio-{os.getpid()}"
    try:
        for rw in ("write", "read"):
            cmd = [
                fio,
                f"--name={name}",
                f"--directory={directory}",
                f"--rw={rw}",
                f"--bs={block_size}",
                f"--iodepth={queue_depth}",
                "--direct=1",
                "--ioengine=libaio",
                f"--size={total_bytes}",
                "--numjobs=1",
                "--end_fsync=1",
                "--output-format=json",
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                return f"fio failed: {out.stderr.strip()[:300]}"
            job = json.loads(out.stdout)["jobs"][0][rw]
            result[rw] = job["bw_bytes"] / GB
        result["cmd"] = " ".join(cmd).replace("--rw=read", "--rw=write|read")
        return result
    finally:
        for p in directory.glob(f"{name}*"):
            p.unlink()


def median_runs(fn, repeat: int) -> dict:
    runs = [fn() for _ in range(repeat)]
    if isinstance(runs[0], str):
        return runs[0]
    out = dict(runs[-1])
    for k in ("write", "read"):
        out[k] = statistics.median(r[k] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        type=pathlib.Path,
        default=None,
        help="directory to test (default: a scratch dir under /work, removed afterwards)",
    )
    ap.add_argument("--gb", type=float, default=2.0, help="data written then read, GB (1e9 bytes)")
    ap.add_argument("--tensor-mb", type=int, default=64, help="size of each tensor, MiB")
    ap.add_argument("--block-size", type=int, default=1 << 20, help="aio block size, bytes (fio bs)")
    ap.add_argument("--queue-depth", type=int, default=8, help="aio queue depth (fio iodepth)")
    ap.add_argument("--thread-count", type=int, default=1, help="aio thread_count")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; the median is reported")
    ap.add_argument("--sweep", action="store_true", help="also sweep block size x queue depth (O_DIRECT, --gb/2)")
    args = ap.parse_args(argv)

    scratch = None
    if args.dir is None:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="zerospeed-nvme-bench-", dir="/work"))
        directory = scratch
    else:
        directory = args.dir.resolve()
    try:
        total = int(args.gb * GB)
        tensor_bytes = args.tensor_mb << 20
        sources = [aligned_empty(tensor_bytes // 4, torch.float32).uniform_() for _ in range(4)]
        print("## Machine\n")
        print("```\n" + "\n".join(machine_info(directory)) + "\n```\n")
        dropped = try_drop_caches()
        print(
            f"global drop_caches: {'ok' if dropped else 'refused (container)'}; per-file "
            "posix_fadvise(DONTNEED) after fsync is used before every read\n"
        )
        kw = {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": args.thread_count}
        rows = {}
        for label, use_direct in (("zerospeed O_DIRECT", None), ("zerospeed buffered", False)):
            rows[label] = median_runs(
                lambda u=use_direct: run_ours(directory, total, tensor_bytes, use_direct=u, sources=sources, **kw),
                args.repeat,
            )
        fio = median_runs(lambda: run_fio(directory, total, args.block_size, args.queue_depth), args.repeat)
        print(
            f"## Sequential swap, {total / GB:.2f} GB, block {args.block_size} B, queue depth {args.queue_depth}, "
            f"thread_count {args.thread_count}, tensors of {args.tensor_mb} MiB\n"
        )
        print("| variant | write GB/s | read GB/s | write / fio | read / fio |")
        print("|---|---:|---:|---:|---:|")
        for label, r in rows.items():
            note = "" if r["direct"] or "buffered" in label else " (no O_DIRECT here)"
            if isinstance(fio, dict):
                ratios = f"{r['write'] / fio['write']:.2f} | {r['read'] / fio['read']:.2f}"
            else:
                ratios = "- | -"
            print(f"| {label}{note} | {r['write']:.3f} | {r['read']:.3f} | {ratios} |")
        if isinstance(fio, dict):
            print(f"| fio libaio direct=1 | {fio['write']:.3f} | {fio['read']:.3f} | 1.00 | 1.00 |")
            print(f"\nfio: `{fio['cmd']}`")
        else:
            print(f"\n{fio}")
        if args.sweep:
            sweep(directory, total // 2, tensor_bytes, sources, args.thread_count)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def sweep(
    directory: pathlib.Path, total: int, tensor_bytes: int, sources: list[torch.Tensor], thread_count: int
) -> None:
    """O_DIRECT bandwidth over block sizes x queue depths (thread_count fixed), with fio at the same point."""
    print(f"\n## Sweep (O_DIRECT, {total / GB:.2f} GB, thread_count {thread_count}): ours / fio GB/s\n")
    print("| block | queue depth | write ours | write fio | read ours | read fio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for block in (256 << 10, 1 << 20, 4 << 20):
        for depth in (4, 8, 16):
            r = run_ours(
                directory,
                total,
                tensor_bytes,
                block_size=block,
                queue_depth=depth,
                thread_count=thread_count,
                use_direct=None,
                sources=sources,
            )
            f = run_fio(directory, total, block, depth)
            fw, fr = (f"{f['write']:.3f}", f"{f['read']:.3f}") if isinstance(f, dict) else ("-", "-")
            print(f"| {block >> 10} KiB | {depth} | {r['write']:.3f} | {fw} | {r['read']:.3f} | {fr} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
