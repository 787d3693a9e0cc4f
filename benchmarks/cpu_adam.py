"""CPU Adam(W) step throughput: torch's implementations, zerospeed's flat sub-group step, DeepSpeed's
CPUAdam, and the memory-bandwidth bound.

    python benchmarks/cpu_adam.py                            # 100M fp32 parameters, all variants
    python benchmarks/cpu_adam.py --params 20e6 --steps 5    # quicker
    python benchmarks/cpu_adam.py --skip-deepspeed           # no JIT build
    python benchmarks/cpu_adam.py --thread-counts 1,2        # the scaling table at these thread counts

Variants (all AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, fp32 states):

- ``torch default``: ``torch.optim.AdamW(params)`` over a GPT-like list of ~150 tensors; on CPU
  torch resolves this to its single-tensor for-loop (``foreach`` is the default only on GPUs).
- ``torch foreach``: the same with ``foreach=True`` (multi-tensor ops, one pass per elementwise op).
- ``torch fused``: the same with ``fused=True`` (one kernel per tensor reading and writing once).
- ``ours (flat sub-groups)``: what zerospeed's offloaded optimizer steps — the same parameters
  flattened into one fp32 tensor per sub-group (``--sub-group-size`` elements), fused AdamW on those.
- ``ours + threads``: the flat buffer cut into one chunk per thread, each chunk stepped by its own
  Python thread (torch releases the GIL in the kernel); kept only if it is faster.
- ``DeepSpeed CPUAdam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` over the tensor list (JIT-built
  C++/AVX op; build time reported separately).
- ``bound``: memory bandwidth / 28 bytes per parameter, from an in-place ``add_`` (Adam's
  read-modify-write pattern) and, for reference, from ``copy_`` (see docs/offload_io.md).

Each variant warms up, then reports the median of ``--steps`` step times as parameters/s.

Thread scaling (``--thread-counts``): the flat fused step (the offloaded optimizer's, which zerospeed's
overlapped step runs on its worker thread) at each intra-op thread count, against the bound *at that
count*. The bound: an fp32 AdamW step reads the parameter, its gradient and the two moments and writes
back the parameter and the moments, 7 x 4 = 28 bytes per parameter, so at best bandwidth / 28
parameters/s; the bandwidth is measured with the same thread count as an in-place ``a.add_(b)`` over
1 GiB tensors (read a, read b, write a: the step's read-modify-write pattern, 12 bytes counted and
moved per element), fastest of 7 runs. One thread rarely saturates the memory bus, so the 1-thread
bound is that one core's bandwidth, not the socket's.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

HPARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
VOCAB, CONTEXT, LAYERS = 50_257, 1024, 12


def gpt_shapes(target: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-like model (12 layers, 50k vocab) whose hidden size makes the
    total close to ``target``: 12 tensors per layer + embeddings + final norm = 148 tensors."""
    # total ~= LAYERS * 12 h^2 + (VOCAB + CONTEXT) h: solve for h, round to a multiple of 64
    a, b = 12 * LAYERS, VOCAB + CONTEXT
    h = max(64, round((-b + math.sqrt(b * b + 4 * a * target)) / (2 * a) / 64) * 64)
    layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [(VOCAB, h), (CONTEXT, h)] + layer * LAYERS + [(h,), (h,)]


def make_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def flat_sub_groups(params: list[torch.nn.Parameter], sub_group_size: int) -> list[torch.nn.Parameter]:
    """The parameters' values and gradients packed into flat fp32 tensors of <= sub_group_size elements."""
    flat_p = torch.cat([p.detach().reshape(-1) for p in params])
    flat_g = torch.cat([p.grad.reshape(-1) for p in params])
    groups = []
    for start in range(0, flat_p.numel(), sub_group_size):
        p = torch.nn.Parameter(flat_p[start : start + sub_group_size].clone())
        p.grad = flat_g[start : start + sub_group_size].clone()
        groups.append(p)
    return groups


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Median seconds of ``steps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def threaded_step(flat: list[torch.nn.Parameter], threads: int) -> Callable[[], None]:
    """One fused AdamW per chunk of the flat buffers, the chunks stepped concurrently by Python threads."""
    chunks = []
    for p in flat:
        size = -(-p.numel() // threads)
        for start in range(0, p.numel(), size):
            c = torch.nn.Parameter(p.detach()[start : start + size])  # shares p's memory
            c.grad = p.grad[start : start + size]
            chunks.append(c)
    opts = [torch.optim.AdamW([c], fused=True, **HPARAMS) for c in chunks]

    def step() -> None:
        workers = [threading.Thread(target=o.step) for o in opts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    return step


def best_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up: a hardware ceiling, so the best run counts."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float]:
    """Host memory bandwidth in bytes/s, two ways, on ``nbytes`` fp32 tensors (far larger than any cache).

    - ``copy_``: bytes read + bytes written. Under-counts real traffic: the destination lines are
      also read before being overwritten (write-allocate), 12 bytes moved per 8 counted.
    - in-place ``a.add_(b)``: reads a and b, writes a back into lines it just read — the
      read-modify-write pattern of an Adam step, so 12 counted bytes are the 12 moved.
    """
    a, b, c = torch.ones(nbytes // 4), torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    copy = 2 * nbytes / best_seconds(lambda: c.copy_(a))
    rmw = 3 * nbytes / best_seconds(lambda: a.add_(b))
    return copy, rmw


def deepspeed_cpu_adam(params: list[torch.nn.Parameter]) -> tuple[Callable[[], None] | None, str]:
    """DeepSpeed's CPUAdam over the list, or None and why it is unavailable; also times the JIT build."""
    from zerospeed.compat import deepspeed_is_shim

    if deepspeed_is_shim():
        return None, "deepspeed here is zerospeed's compatibility shim, not DeepSpeed"
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as err:  # noqa: BLE001 - any import failure means "not available", reported as such
        return None, f"deepspeed not importable: {type(err).__name__}: {err}"
    t0 = time.perf_counter()
    try:
        CPUAdamBuilder().load()
    except Exception as err:  # noqa: BLE001
        return None, f"CPUAdam build failed after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}"
    build = time.perf_counter() - t0
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(params, adamw_mode=True, **HPARAMS)
    return opt.step, f"CPUAdamBuilder().load(): {build:.1f} s (includes the JIT build when not cached)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="target parameter count (fp32)")
    ap.add_argument("--sub-group-size", type=float, default=1e9, help="elements per flat sub-group (ours)")
    ap.add_argument("--steps", type=int, default=7, help="measured steps per variant (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--thread-counts", default="1,2", help="intra-op thread counts of the scaling table ('' = none)")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()

    print("## Machine\n\n```")
    print(
        f"nproc: {os.cpu_count()}, torch.get_num_threads(): {threads}, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )
    try:
        print(
            "\n".join(
                ln.strip()
                for ln in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
                if "Model name" in ln
            )
        )
    except OSError:
        pass
    print("```\n")

    bandwidth_before = memory_bandwidth()  # measured before and after the variants; the higher wins
    shapes = gpt_shapes(int(args.params))
    params = make_params(shapes)
    n = sum(p.numel() for p in params)
    print(
        f"{n / 1e6:.1f}M fp32 parameters in {len(params)} tensors (GPT-like, hidden {shapes[0][1]}); "
        f"sub-group size {int(args.sub_group_size):,}\n"
    )

    rows: list[tuple[str, float]] = []
    notes: list[str] = []

    def run(label: str, step: Callable[[], None]) -> float:
        s = time_steps(step, args.warmup, args.steps)
        rows.append((label, s))
        print(f"  {label}: {s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
        return s

    for label, kw in (
        ("torch default (for-loop on CPU)", {}),
        ("torch foreach=True", {"foreach": True}),
        ("torch fused=True", {"fused": True}),
    ):
        run(label, torch.optim.AdamW(params, **kw, **HPARAMS).step)

    flat = flat_sub_groups(params, int(args.sub_group_size))
    ours = run(
        f"ours: fused AdamW on {len(flat)} flat sub-group(s)", torch.optim.AdamW(flat, fused=True, **HPARAMS).step
    )
    if threads > 1:
        t = time_steps(threaded_step(flat, threads), args.warmup, args.steps)
        verdict = "kept" if t < ours else "not kept: slower than one fused call"
        notes.append(f"ours split across {threads} Python threads: {t * 1e3:.1f} ms/step ({verdict})")
        if t < ours:
            rows.append((f"ours + {threads} threads", t))
    counts = [int(c) for c in args.thread_counts.split(",") if c.strip()]
    scaling = thread_scaling(flat, n, counts, args.warmup, args.steps)
    del flat

    if not args.skip_deepspeed:
        step, note = deepspeed_cpu_adam(params)
        notes.append(f"DeepSpeed CPUAdam: {note}")
        if step is not None:
            run("DeepSpeed CPUAdam (C++/AVX, JIT-built)", step)

    copy_bw, rmw_bw = (max(x, y) for x, y in zip(bandwidth_before, memory_bandwidth()))
    bound = rmw_bw / 28
    default = rows[0][1]
    print("| variant | ms/step | Mparams/s | vs torch default | vs bound |")
    print("|---|---:|---:|---:|---:|")
    for label, s in rows:
        rate = n / s
        print(f"| {label} | {s * 1e3:.1f} | {rate / 1e6:.1f} | {default / s:.2f}x | {rate / bound:.2f} |")
    for what, bw in (
        (f"in-place add_ bandwidth {rmw_bw / 1e9:.1f} GB/s", rmw_bw),
        (f"copy_ bandwidth {copy_bw / 1e9:.1f} GB/s", copy_bw),
    ):
        b = bw / 28
        print(
            f"| bound: {what} / 28 B per parameter | {n / b * 1e3:.1f} | {b / 1e6:.1f} | "
            f"{default * b / n:.2f}x | {b / bound:.2f} |"
        )
    if scaling:
        print("\nThe flat fused step (ours) by intra-op threads, each against the bound at its own thread count:\n")
        print("| threads | ms/step | Mparams/s | add_ bandwidth GB/s | bound Mparams/s (bw / 28 B) | of bound |")
        print("|---:|---:|---:|---:|---:|---:|")
        for t, s, bw in scaling:
            print(
                f"| {t} | {s * 1e3:.1f} | {n / s / 1e6:.1f} | {bw / 1e9:.1f} | {bw / 28 / 1e6:.1f} "
                f"| {n / s / (bw / 28):.2f} |"
            )
    print()
    for line in notes:
        print(f"- {line}")
    return 0


def thread_scaling(
    flat: list[torch.nn.Parameter], n: int, counts: list[int], warmup: int, steps: int
) -> list[tuple[int, float, float]]:
    """(threads, seconds per flat fused step, in-place add_ bandwidth) at each thread count; the
    process's own thread count is restored afterwards."""
    own = torch.get_num_threads()
    out = []
    try:
        for t in counts:
            torch.set_num_threads(t)
            s = time_steps(torch.optim.AdamW(flat, fused=True, **HPARAMS).step, warmup, steps)
            out.append((t, s, memory_bandwidth()[1]))
            print(f"  {t} thread(s): {s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(own)
    return out


if __name__ == "__main__":
    sys.exit(main())
