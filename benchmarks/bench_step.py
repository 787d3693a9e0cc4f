"""Training-step benchmark: zerospeed (ZeRO stage 0) against PyTorch DDP, and DeepSpeed if installed.

    python benchmarks/bench_step.py --nproc 2 --steps 10 --warmup 3 --out benchmarks/results.md

Each variant runs as ``--nproc`` fresh processes (RANK/WORLD_SIZE/MASTER_ADDR/... in the
environment, gloo on CPU, NCCL on GPU), one variant at a time, with the same OMP_NUM_THREADS
(cores // nproc). They train the same GPT from the same seed on the same micro-batches with the
same micro batch, gradient accumulation, AdamW and clipping, so the losses should agree and only
the step machinery differs. The table reports, per variant: the median over the measured optimizer
steps of the slowest rank's step time, tokens/s derived from it, peak memory per rank (CPU: peak
RSS, CUDA: max allocated), the final loss, and ratios against DDP.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent / "workers.py"
VARIANTS = ("zerospeed", "ddp", "deepspeed")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps (>= 10 recommended)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run before measuring")
    p.add_argument("--model-size", choices=("tiny", "small"), default="small")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) per variant")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="micro batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1,
                   help="run every variant this many times, alternating the order; steps are pooled")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per variant")
    p.add_argument("--out", type=Path, default=None, help="append the table and machine description here")
    args = p.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.repeats < 1:
        p.error("need --steps >= 1, --warmup >= 0, --nproc >= 1 and --repeats >= 1")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(variant: str, args: argparse.Namespace, workdir: Path, threads: int) -> list[dict]:
    """Run one variant on nproc processes; return each rank's result, or raise with the failing log."""
    spec = {"variant": variant, "out_dir": str(workdir)} | {
        k: getattr(args, k) for k in ("steps", "warmup", "model_size", "seq_len", "micro_batch",
                                      "grad_accum", "seed", "corpus_bytes")}
    port, procs = free_port(), []
    for rank in range(args.nproc):
        env = os.environ | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
            "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads)}
        if variant == "deepspeed" and not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
        log = open(workdir / f"{variant}.rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    try:
        wait_all([p for p, _ in procs], args.timeout, variant, workdir)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [json.loads((workdir / f"{variant}.rank{r}.json").read_text()) for r in range(args.nproc)]


def wait_all(procs: list[subprocess.Popen], timeout: float, variant: str, workdir: Path) -> None:
    """Wait for every rank; the first failure (or the timeout) aborts the variant with that rank's log."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise failure(variant, workdir, failed[0], f"rank {failed[0]} exited with {codes[failed[0]]}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise failure(variant, workdir, 0, f"timed out after {timeout:.0f}s")
        time.sleep(0.2)


def failure(variant: str, workdir: Path, rank: int, why: str) -> RuntimeError:
    """An error whose first line names the variant, the rank and the log's last line (the exception)."""
    tail = (workdir / f"{variant}.rank{rank}.log").read_text()[-3000:]
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "(empty log)")
    return RuntimeError(f"{variant}: {why}: {last}\n--- rank {rank}'s log ends ---\n{tail}")


def summarize(runs: list[list[dict]], tokens_per_step: int) -> dict:
    """Pool the repeats of one variant. A step is as slow as its slowest rank, so the reported time
    is the median over all measured steps of the per-step max over ranks; memory is the per-rank peak."""
    per_step = [max(step) for ranks in runs for step in zip(*(r["step_times"] for r in ranks))]
    median = statistics.median(per_step)
    peaks = [max(ranks[r]["peak_memory"] for ranks in runs) for r in range(len(runs[0]))]
    return {"median_step_s": median, "tokens_per_s": tokens_per_step / median, "peak_memory": peaks,
            "losses": runs[0][0]["losses"], "threads": runs[0][0]["threads"]}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def table(results: dict[str, dict], notes: list[str]) -> str:
    base = results.get("ddp")
    lines = ["| variant | median step (ms) | tokens/s | peak memory per rank (MiB) | final loss "
             "| step time / DDP | tokens/s / DDP | peak memory / DDP |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        ratios = ["—"] * 3
        if base:
            ratios = [f"{r['median_step_s'] / base['median_step_s']:.2f}",
                      f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                      f"{max(r['peak_memory']) / max(base['peak_memory']):.2f}"]
        lines.append(f"| {name} | {1000 * r['median_step_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{' / '.join(mib(m) for m in r['peak_memory'])} | {r['losses'][-1]:.4f} | "
                     + " | ".join(ratios) + " |")
    if "zerospeed" in results and base:
        diff = max(abs(a - b) for a, b in zip(results["zerospeed"]["losses"], base["losses"]))
        notes.append(f"max |loss(zerospeed) - loss(DDP)| over all {len(base['losses'])} steps, rank 0: {diff:.2e}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"{cpu}, {os.cpu_count()} cores, GPU: {gpu}; torch {torch.__version__}, "
            f"Python {platform.python_version()}, {platform.system()} {platform.release()}")


def run_variants(args: argparse.Namespace, variants: list[str], threads: int,
                 notes: list[str]) -> dict[str, list[list[dict]]]:
    """Every variant's per-rank results for each repeat; a variant that fails once is dropped."""
    runs: dict[str, list[list[dict]]] = {}
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        for rep in range(args.repeats):
            # Alternate the order so slow drift on a shared machine does not favour one variant.
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                if variant in failed:
                    continue
                print(f"[{rep + 1}/{args.repeats}] running {variant} on {args.nproc} processes ...",
                      file=sys.stderr, flush=True)
                try:
                    runs.setdefault(variant, []).append(launch(variant, args, Path(tmp), threads))
                except RuntimeError as e:
                    failed.add(variant)
                    notes.append(f"FAILED {str(e).splitlines()[0]}")
                    print(e, file=sys.stderr)
    return {v: r for v, r in runs.items() if v not in failed}


def main() -> None:
    args = parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    tokens_per_step = args.micro_batch * args.grad_accum * args.nproc * args.seq_len
    notes: list[str] = []
    variants = list(args.variants)
    if "deepspeed" in variants and importlib.util.find_spec("deepspeed") is None:
        variants.remove("deepspeed")
        notes.append("deepspeed: skipped (not installed; `pip install deepspeed` to include it)")
    runs = run_variants(args, variants, threads, notes)
    results = {v: summarize(runs[v], tokens_per_step) for v in variants if v in runs}
    header = (f"### bench_step — {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}\n\n"
              f"{args.model_size} GPT, seq {args.seq_len}, micro batch {args.micro_batch} x accum "
              f"{args.grad_accum} x {args.nproc} ranks = {tokens_per_step:,} tokens/step; "
              f"{args.steps} measured steps after {args.warmup} warm-up, x {args.repeats} repeat(s); "
              f"OMP_NUM_THREADS={threads}\n\n"
              f"Machine: {machine()}\n\n")
    text = header + table(results, notes) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
