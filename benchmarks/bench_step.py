"""Training-step benchmark: zerospeed ZeRO stages 0-3 against PyTorch DDP (+ZeRO-1), FSDP2 and DeepSpeed.

    python benchmarks/bench_step.py --nproc 2 --steps 10 --warmup 3 --out benchmarks/results.md
    python benchmarks/bench_step.py --variants zs1,zs2,ddp_zero,ds1,ds2   # a subset
    python benchmarks/bench_step.py --variants zs0,zs1,zs2,zs3,ddp --baseline ../baseline  # before/after

Each variant runs as ``--nproc`` fresh processes (RANK/WORLD_SIZE/MASTER_ADDR/... in the
environment, gloo on CPU, NCCL on GPU), one variant at a time, with the same OMP_NUM_THREADS
(cores // nproc). They train the same GPT from the same seed on the same micro-batches with the
same micro batch, gradient accumulation, AdamW and clipping, so the losses should agree and only
the step machinery differs. The table reports, per variant: the median over the measured optimizer
steps of the slowest rank's step time, tokens/s derived from it, peak memory per rank (CPU: peak
RSS, CUDA: max allocated), the final loss, its largest gap to DDP's, and ratios against DDP. For the
zerospeed variants a second table breaks the measured steps' communication down per collective
kind (from ``zerospeed.comm.STATS``): calls, bytes on the wire per rank and seconds, per step; a
third compares the stage-3 variants' bytes with the theoretical volume (``stage3_traffic``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from zerospeed.utils.ports import free_port

WORKER = Path(__file__).resolve().parent / "workers.py"
# Offload variants (ZeRO-Offload / ZeRO-Infinity), for zerospeed and DeepSpeed alike: *_cpu offloads the
# optimizer (stage 2) or optimizer + parameters (stage 3) to host memory; *_nvme the optimizer to swap
# files, *_nvmeall the parameters too (under the run's scratch directory, or --nvme-path).
OFFLOAD = ("2_cpu", "3_cpu", "2_nvme", "3_nvme", "3_nvmeall")
VARIANTS = (
    "zs0",
    "zs1",
    "zs2",
    "zs3",
    "zs3_noprefetch",
    "zspp",
    "ddp",
    "ddp_zero",
    "fsdp2",
    "fsdp2_noprefetch",
    "ds0",
    "ds1",
    "ds2",
    "ds3",
    "ds3_noprefetch",
) + tuple(f"{lib}{o}" for lib in ("zs", "ds") for o in OFFLOAD)
ALIASES = {"zerospeed": "zs0", "deepspeed": "ds0"}  # the names of the stage-0-only benchmark
STAGE = {
    "zs0": 0,
    "zs1": 1,
    "zs2": 2,
    "zs3": 3,
    "zs3_noprefetch": 3,
    "zspp": 0,
    "ds0": 0,
    "ds1": 1,
    "ds2": 2,
    "ds3": 3,
    "ds3_noprefetch": 3,
    "ddp": 0,
    "ddp_zero": 0,
    "fsdp2": 3,
    "fsdp2_noprefetch": 3,
}
STAGE |= {f"{lib}{o}": int(o[0]) for lib in ("zs", "ds") for o in OFFLOAD}


BASE_SUFFIX = "@base"  # a zerospeed variant run against the --baseline checkout


def resolve_variants(text: str) -> list[str]:
    """Comma-separated names (aliases allowed) -> canonical variants, first occurrence order kept.

    Raises ValueError naming any unknown name.
    """
    names = [ALIASES.get(v.strip(), v.strip()) for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)} (aliases: {ALIASES})")
    return list(dict.fromkeys(names))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps (>= 10 recommended)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run before measuring")
    p.add_argument("--model-size", choices=("tiny", "small", "gpt4x256"), default="small")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) per variant")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="micro batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ",".join(VARIANTS) + " (zerospeed = zs0, deepspeed = ds0)",
    )
    p.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=500_000_000,
        help="zero_optimization.reduce_bucket_size (elements) for zs* and ds*",
    )
    p.add_argument(
        "--allgather-bucket-size",
        type=int,
        default=500_000_000,
        help="zero_optimization.allgather_bucket_size (elements) for stages 1 and 2",
    )
    p.add_argument(
        "--overlap-comm",
        choices=("true", "false"),
        default="true",
        help="zero_optimization.overlap_comm for stages 1 and 2 (zerospeed and DeepSpeed alike)",
    )
    p.add_argument(
        "--prefetch-bucket-size",
        type=int,
        default=50_000_000,
        help="zero_optimization.stage3_prefetch_bucket_size (elements) for zs3 and ds3 "
        "(the *_noprefetch variants use 0)",
    )
    p.add_argument(
        "--param-persistence-threshold",
        type=int,
        default=0,
        help="zero_optimization.stage3_param_persistence_threshold for zs3* and ds3* (0: every unit is sharded)",
    )
    p.add_argument(
        "--max-live-parameters",
        type=int,
        default=1_000_000_000,
        help="zero_optimization.stage3_max_live_parameters for zs3* and ds3*",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every variant this many times, alternating the order; steps are pooled",
    )
    p.add_argument(
        "--nvme-path",
        type=Path,
        default=None,
        help="directory for the *_nvme variants' swap files (default: the run's scratch directory)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each model: engine.compile() for zerospeed / DeepSpeed, model.compile() "
        "for DDP / FSDP2 (compilation happens in the warm-up steps, which are not timed)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per variant")
    p.add_argument("--plot", type=Path, default=None, help="also write a bar chart of the step times (PNG)")
    p.add_argument("--out", type=Path, default=None, help="append the table and machine description here")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another zerospeed checkout (e.g. a git worktree of an older commit): every zs* variant "
        "also runs against it, as '<variant>@base', and a before/after table is printed",
    )
    args = p.parse_args()
    try:
        args.variants = resolve_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    if args.baseline is not None:
        if not (args.baseline / "zerospeed" / "__init__.py").is_file():
            p.error(f"--baseline {args.baseline}: no zerospeed package there (give the checkout's root)")
        args.variants += [f"{v}{BASE_SUFFIX}" for v in args.variants if v.startswith("zs")]
    args.overlap_comm = args.overlap_comm == "true"
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.repeats < 1:
        p.error("need --steps >= 1, --warmup >= 0, --nproc >= 1 and --repeats >= 1")
    return args


def launch(variant: str, args: argparse.Namespace, workdir: Path, threads: int) -> list[dict]:
    """Run one variant on nproc processes; return each rank's result, or raise with the failing log."""
    kind, on_baseline = variant.removesuffix(BASE_SUFFIX), variant.endswith(BASE_SUFFIX)
    spec = {"variant": kind, "stage": STAGE[kind], "out_dir": str(workdir / variant)} | {
        k: getattr(args, k)
        for k in (
            "steps",
            "warmup",
            "model_size",
            "seq_len",
            "micro_batch",
            "grad_accum",
            "seed",
            "corpus_bytes",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "overlap_comm",
            "param_persistence_threshold",
            "max_live_parameters",
            "compile",
        )
    }
    spec["prefetch_bucket_size"] = 0 if kind.endswith("_noprefetch") else args.prefetch_bucket_size
    spec["offload"] = kind.split("_", 1)[1] if kind[2:] in OFFLOAD else "none"
    spec["nvme_path"] = str(args.nvme_path or workdir)
    (workdir / variant).mkdir(exist_ok=True)
    port, procs = free_port(), []
    for rank in range(args.nproc):
        env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.nproc),
            "LOCAL_WORLD_SIZE": str(args.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
        if variant.startswith("ds") and not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
        if on_baseline:  # imported ahead of the installed (editable) zerospeed
            env["PYTHONPATH"] = os.pathsep.join([str(args.baseline.resolve()), env.get("PYTHONPATH", "")])
        log = open(workdir / f"{variant}.rank{rank}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), json.dumps(spec)], env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    try:
        wait_all([p for p, _ in procs], args.timeout, variant, workdir)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [json.loads((workdir / variant / f"{kind}.rank{r}.json").read_text()) for r in range(args.nproc)]


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
    return {
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "peak_memory": peaks,
        "losses": runs[0][0]["losses"],
        "threads": runs[0][0]["threads"],
        "comm": comm_per_step(runs),
        "sizes": {k: runs[0][0].get(k, 0) for k in ("params", "param_bytes", "tied_params")},
    }


def stage3_theory_bytes(params: int, param_bytes: int, world: int, grad_accum: int) -> float:
    """Stage-3 bytes one rank sends per optimizer step under ring algorithms, ignoring tags, padding and
    tied parameters: every micro-step all-gathers the parameters twice (forward and backward, in the
    model dtype) and reduce-scatters the fp32 gradients once, each moving (N-1)/N of the full size.
    In fp32 that is the textbook 3 x parameter bytes x (N-1)/N per micro-step."""
    return grad_accum * (world - 1) / world * params * (2 * param_bytes + 4)


def stage3_traffic(results: dict[str, dict], world: int, grad_accum: int) -> str:
    """The zerospeed stage-3 variants' measured wire bytes per step against ``stage3_theory_bytes``,
    with the known extras: an 8-byte tag all-gathered with every unit gather (half the all-gather
    calls), the tied head's gradient share reduce-scattered on its own (Note [tied uses]), and the rest (padding of
    every unit to a multiple of N, the gradient-norm all-reduce)."""
    lines = [
        "| variant | wire/step per rank (MiB) | theory (MiB) | measured / theory | + tags (KiB) "
        "| + tied head's gradient share (MiB) | rest (KiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if STAGE.get(name) != 3 or not r["comm"] or not r["sizes"]["params"]:
            continue
        z = r["sizes"]
        measured = sum(c["wire_bytes"] for c in r["comm"].values())
        theory = stage3_theory_bytes(z["params"], z["param_bytes"], world, grad_accum)
        tags = r["comm"].get("all_gather", {}).get("calls", 0) / 2 * 8 * (world - 1)
        tied = grad_accum * (world - 1) / world * z["tied_params"] * 4
        lines.append(
            f"| {name} | {measured / 2**20:,.3f} | {theory / 2**20:,.3f} | {measured / theory:.4f} | "
            f"{tags / 2**10:,.2f} | {tied / 2**20:,.3f} | {(measured - theory - tags - tied) / 2**10:,.2f} |"
        )
    if len(lines) == 2:
        return ""
    note = (
        "- theory = GAS x (N-1)/N x P x (2b + 4) bytes: P parameters (tied once), b bytes per model-dtype "
        "element; two all-gathers of the parameters per micro-step (forward, backward) and one fp32 "
        "gradient reduce-scatter — 3 x 4P x (N-1)/N per micro-step in fp32. tags = 8 bytes x (N-1) per unit "
        "gather (every gather also all-gathers the unit's index; half the all-gather calls). tied = the "
        "head's share of the tied gradient, reduce-scattered in fp32 on its own, GAS x (N-1)/N x P_tied x 4 "
        "(the head's forward gathers the embedding's unit once more, and the embedding's backward, which "
        "reads no weight, gathers nothing: those cancel). rest = padding "
        "of each unit to a multiple of N plus the gradient-norm all-reduce"
    )
    return "Stage-3 bytes per optimizer step vs theory (zerospeed)\n\n" + "\n".join(lines) + "\n\n" + note + "\n"


def comm_per_step(runs: list[list[dict]]) -> dict[str, dict[str, float]]:
    """Per collective kind, per measured step: calls, payload and wire bytes (rank 0's; every rank
    sends the same), and seconds (the slowest rank's). Empty when the workers sent no counters."""
    if not all("comm" in r for ranks in runs for r in ranks):
        return {}
    steps = sum(len(ranks[0]["step_times"]) for ranks in runs)

    def total(kind: str, field: str, rank: int) -> float:
        return sum(ranks[rank]["comm"].get(kind, {}).get(field, 0) for ranks in runs)

    kinds = sorted({k for ranks in runs for r in ranks for k in r["comm"]})
    return {
        kind: {
            "calls": total(kind, "calls", 0) / steps,
            "payload_bytes": total(kind, "payload_bytes", 0) / steps,
            "wire_bytes": total(kind, "wire_bytes", 0) / steps,
            "seconds": max(total(kind, "seconds", r) for r in range(len(runs[0]))) / steps,
        }
        for kind in kinds
    }


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def table(results: dict[str, dict], notes: list[str]) -> str:
    base = results.get("ddp")
    lines = [
        "| variant | median step (ms) | tokens/s | peak memory per rank (MiB) | final loss "
        "| max \\|Δloss\\| vs DDP | step time / DDP | tokens/s / DDP | peak memory / DDP |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        ratios, gap = ["—"] * 3, "—"
        if base:
            ratios = [
                f"{r['median_step_s'] / base['median_step_s']:.2f}",
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                f"{max(r['peak_memory']) / max(base['peak_memory']):.2f}",
            ]
            gap = f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.1e}"
        lines.append(
            f"| {name} | {1000 * r['median_step_s']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{' / '.join(mib(m) for m in r['peak_memory'])} | {r['losses'][-1]:.4f} | {gap} | "
            + " | ".join(ratios)
            + " |"
        )
    if base:
        notes.append(
            f"Δloss: rank 0's mean micro-batch loss per step, over all {len(base['losses'])} steps (warm-up included)"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def before_after(results: dict[str, dict], baseline: Path) -> str:
    """Each zerospeed variant against the same variant run on the --baseline checkout."""
    lines = [
        f"Before (`{baseline}`) / after (this checkout), same invocation:",
        "",
        "| variant | before: median step (ms) | after (ms) | after / before | peak memory before / after (MiB) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        b = results.get(name + BASE_SUFFIX)
        if b is None:
            continue
        lines.append(
            f"| {name} | {1000 * b['median_step_s']:.1f} | {1000 * r['median_step_s']:.1f} | "
            f"{r['median_step_s'] / b['median_step_s']:.3f} | {mib(max(b['peak_memory']))} / "
            f"{mib(max(r['peak_memory']))} |"
        )
    return "\n".join(lines) + "\n"


def comm_table(results: dict[str, dict]) -> str:
    """Where the time goes: the zerospeed variants' collectives per measured step, one total row each."""
    lines = [
        "| variant | collective | calls/step | payload/step (MiB) | wire/step per rank (MiB) "
        "| ms/step (slowest rank) | % of median step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if not r["comm"]:
            continue
        total = {f: sum(c[f] for c in r["comm"].values()) for f in ("calls", "payload_bytes", "wire_bytes", "seconds")}
        for kind, c in [*r["comm"].items(), ("**total**", total)]:
            lines.append(
                f"| {name} | {kind} | {c['calls']:.1f} | {c['payload_bytes'] / 2**20:,.3f} | "
                f"{c['wire_bytes'] / 2**20:,.3f} | {1000 * c['seconds']:.2f} | "
                f"{100 * c['seconds'] / r['median_step_s']:.0f} |"
            )
    if len(lines) == 2:
        return ""
    note = (
        "- comm counters (zerospeed.comm.STATS) reset after warm-up; wire = bytes one rank sends under "
        "ring algorithms; ms run from issue to the result being usable, so overlapped collectives "
        "(stage 0 always, stages 1-3 with overlap_comm) show latency, not necessarily lost time, "
        "and kinds can add up past 100 %"
    )
    return "Communication per optimizer step (zerospeed variants)\n\n" + "\n".join(lines) + "\n\n" + note + "\n"


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
    return (
        f"{cpu}, {os.cpu_count()} cores, GPU: {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def run_variants(
    args: argparse.Namespace, variants: list[str], threads: int, notes: list[str]
) -> dict[str, list[list[dict]]]:
    """Every variant's per-rank results for each repeat; a variant that fails once is dropped."""
    runs: dict[str, list[list[dict]]] = {}
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        for rep in range(args.repeats):
            # Alternate the order so slow drift on a shared machine does not favour one variant.
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                if variant in failed:
                    continue
                print(
                    f"[{rep + 1}/{args.repeats}] running {variant} on {args.nproc} processes ...",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    runs.setdefault(variant, []).append(launch(variant, args, Path(tmp), threads))
                except RuntimeError as e:
                    failed.add(variant)
                    notes.append(f"FAILED {str(e).splitlines()[0]}")
                    print(e, file=sys.stderr)
    return {v: r for v, r in runs.items() if v not in failed}


def real_deepspeed_installed() -> bool:
    """True when `import deepspeed` is DeepSpeed itself, not zerospeed's compatibility shim (which
    would make the ds* variants measure zerospeed under DeepSpeed's name)."""
    from zerospeed.compat import deepspeed_is_shim

    return importlib.util.find_spec("deepspeed") is not None and not deepspeed_is_shim()


def main() -> None:
    args = parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    tokens_per_step = args.micro_batch * args.grad_accum * args.nproc * args.seq_len
    notes: list[str] = []
    variants = list(args.variants)
    skipped = [v for v in variants if v.startswith("ds")]
    if skipped and not real_deepspeed_installed():
        variants = [v for v in variants if v not in skipped]
        notes.append(
            f"{', '.join(skipped)}: skipped (the real DeepSpeed is not installed here — `deepspeed` is "
            "absent or zerospeed's shim; run in an environment with `pip install deepspeed` to include them)"
        )
    runs = run_variants(args, variants, threads, notes)
    results = {v: summarize(runs[v], tokens_per_step) for v in variants if v in runs}
    header = (
        f"### bench_step — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}\n\n"
        f"{args.model_size} GPT, seq {args.seq_len}, micro batch {args.micro_batch} x accum "
        f"{args.grad_accum} x {args.nproc} ranks = {tokens_per_step:,} tokens/step; "
        f"{args.steps} measured steps after {args.warmup} warm-up, x {args.repeats} repeat(s); "
        f"OMP_NUM_THREADS={threads}; zero_optimization: reduce_bucket_size "
        f"{args.reduce_bucket_size:,}, allgather_bucket_size {args.allgather_bucket_size:,}, "
        f"overlap_comm {str(args.overlap_comm).lower()} (stages 1-3); stage 3: "
        f"stage3_prefetch_bucket_size {args.prefetch_bucket_size:,} (0 for *_noprefetch), "
        f"stage3_param_persistence_threshold {args.param_persistence_threshold:,}"
        f"{' (every unit sharded)' if args.param_persistence_threshold == 0 else ''}, "
        f"stage3_max_live_parameters {args.max_live_parameters:,}; fsdp2 reduce-scatters every "
        "micro-step\n\n"
        f"Machine: {machine()}\n\n"
    )
    comm_text = comm_table(results)
    traffic = stage3_traffic(results, args.nproc, args.grad_accum)
    comm_text += ("\n" + traffic) if traffic else ""
    text = header + table(results, notes) + "\n" + ("\n" + comm_text if comm_text else "")
    if args.baseline is not None:
        text += "\n" + before_after(results, args.baseline)
    print(text)
    if args.plot and results:
        from zerospeed.monitor.plot import save_bar_chart

        names = list(results)
        save_bar_chart(
            args.plot,
            names,
            [results[v]["median_step_s"] * 1e3 for v in names],
            title=f"median step time, {args.model_size} GPT, {args.nproc} ranks",
            unit=" ms",
            xlabel="median step time (ms)",
            width=720,
        )
        print(f"plot: {args.plot}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
