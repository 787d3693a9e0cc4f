"""Peak memory and time of attention forward + backward: block-sparse (Fixed, BigBird) vs dense.

    python benchmarks/sparse_attention.py [--seqs 1024,4096,16384 --extra-seqs 32768 --heads 8 --dim 64
                                           --block 16 --repeats 2 --threads 0]

One invocation prints a markdown table. Each case runs in a fresh subprocess (`--case`), on fp32
inputs q, k, v [1, heads, L, dim] that require grad:

- rows: `dense SDPA` (torch.nn.functional.scaled_dot_product_attention; on CPU a fused flash kernel),
  `dense math` (softmax(q k^T / sqrt(d)) v written out, the [L, L] scores materialised; only up to
  --math-max), `fixed` (FixedSparsityConfig(heads, block): DeepSpeed's defaults, 4-block windows with one
  global block each, so the blocks per row grow as L / (4 block)) and `bigbird` (BigBirdSparsityConfig
  with DeepSpeed's class defaults: 1 random, 3 sliding-window and 1 global block: a fixed number of
  blocks per row except the global one), both through zerospeed's gather kernel. --extra-seqs run
  bigbird only (the dense rows would take minutes each).
- peak MiB: the process's peak resident set during one forward + backward, above its resident set
  just before it: the kernel's high-water mark (VmHWM) is reset first by writing 5 to
  /proc/self/clear_refs, then read from /proc/self/status. It counts everything the process touches
  (output, gradients, temporaries, allocator slack); nothing is taken from torch's own counters. The
  memory subprocess sets MALLOC_MMAP_THRESHOLD_ so that freed large tensors go back to the OS instead
  of being reused unseen from the heap, and first runs the same attention on 16 blocks so that
  library pools and thread stacks are already allocated.
- layout MiB: what the sparse rows hold before the measurement: DeepSpeed's int64 layout
  [heads, L/block, L/block] plus zerospeed's index tables (bool layout copy, per-block tables).
- time: in a second fresh subprocess (default allocator settings), the median wall time of --repeats
  forward + backward runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time

KINDS = ("dense SDPA", "dense math", "fixed", "bigbird")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _attention(kind: str, args, seq: int):
    """(fn(q, k, v) -> out, layout MiB, blocks per row)."""
    import torch
    import torch.nn.functional as F

    from zerospeed.ops.sparse_attention import (
        BigBirdSparsityConfig,
        BlockSparsePlan,
        FixedSparsityConfig,
        block_sparse_attention,
    )

    if kind == "dense SDPA":
        return F.scaled_dot_product_attention, 0.0, seq // args.block
    if kind == "dense math":
        return (lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / args.dim**0.5, -1) @ v), 0.0, seq // args.block
    random.seed(0)
    config = (FixedSparsityConfig if kind == "fixed" else BigBirdSparsityConfig)(args.heads, block=args.block)
    layout = config.make_layout(seq)
    plan = BlockSparsePlan(layout, args.block)
    tables = plan.layout.nbytes + plan.kv_blocks.nbytes + plan.row_counts.nbytes + plan.row_starts.nbytes
    per_row = plan.num_active / (args.heads * plan.num_blocks)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, None, args.block, plan=plan)
    return fn, (layout.nbytes + tables) / 2**20, per_row


def run_case(kind: str, seq: int, args, what: str) -> dict:
    """'memory': the peak of one forward + backward; 'time': the median of --repeats after a warm-up."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def inputs(length):
        return [torch.randn(1, args.heads, length, args.dim, requires_grad=True) for _ in range(3)]

    def step(fn, q, k, v):
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))

    # Libraries allocate their pools and thread stacks on first use: a small run of the same kind first.
    step(_attention(kind, args, 16 * args.block)[0], *inputs(16 * args.block))
    fn, layout_mib, per_row = _attention(kind, args, seq)
    q, k, v = inputs(seq)
    result = {"layout_mib": layout_mib, "per_row": per_row}
    if what == "memory":
        from zerospeed.accelerator import reset_kernel_peak_rss

        if not reset_kernel_peak_rss():
            return {"error": "cannot reset VmHWM (/proc/self/clear_refs)"}
        before = _status("VmRSS")
        step(fn, q, k, v)
        return dict(result, peak_mib=(_status("VmHWM") - before) / 2**20)
    start = time.perf_counter()
    step(fn, q, k, v)
    times = [time.perf_counter() - start]
    for _ in range(args.repeats if times[0] < 20 else 0):
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        step(fn, q, k, v)
        times.append(time.perf_counter() - start)
    return dict(result, seconds=statistics.median(times[1:] or times))


def _subprocess(kind: str, seq: int, args, what: str) -> dict:
    env = dict(os.environ)
    if what == "memory":  # freed large blocks go back to the OS at once (slow, so not for timing)
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [
        sys.executable,
        __file__,
        "--case",
        kind,
        str(seq),
        what,
        "--heads",
        str(args.heads),
        "--dim",
        str(args.dim),
        "--block",
        str(args.block),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cases(args) -> list[tuple[str, int]]:
    seqs = [int(s) for s in args.seqs.split(",") if s]
    extra = [int(s) for s in args.extra_seqs.split(",") if s]
    cases = [(kind, seq) for seq in seqs for kind in KINDS if kind != "dense math" or seq <= args.math_max]
    return cases + [("bigbird", seq) for seq in extra]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--extra-seqs", default="32768", help="sequence lengths run for bigbird only")
    parser.add_argument("--math-max", type=int, default=4096, help="longest sequence for the dense math row")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per case (0: torch's default)")
    parser.add_argument("--case", nargs=3, metavar=("KIND", "SEQ", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args, args.case[2])))
        return
    import torch

    threads = args.threads or torch.get_num_threads()
    print(
        f"attention forward + backward, fp32, batch 1, {args.heads} heads x {args.dim}, block {args.block}; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} torch threads, torch {torch.__version__}\n"
    )
    print(
        "| attention | L | active blocks / row | peak MiB (fwd+bwd) | peak / L (KiB per token) | layout MiB | "
        "fwd+bwd (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, seq in _cases(args):
        r = _subprocess(kind, seq, args, "memory")
        r.update(_subprocess(kind, seq, args, "time") if "error" not in r else {})
        if "error" in r:
            print(f"| {kind} | {seq} | - | {r['error']} | | | |", flush=True)
            continue
        print(
            f"| {kind} | {seq} | {r['per_row']:.1f} | {r['peak_mib']:.1f} | {r['peak_mib'] * 1024 / seq:.2f} | "
            f"{r['layout_mib']:.1f} | {r['seconds']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
