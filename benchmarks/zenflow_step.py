"""ZenFlow against plain CPU offload and the overlapped CPU step: step times on this machine, one invocation.

    python benchmarks/zenflow_step.py                     # ZeRO-2, a 27M GPT, 16 measured steps per mode
    python benchmarks/zenflow_step.py --steps 8 --stage 1

One process (a world of one, gloo), one engine per mode, the same GPT, data and AdamW (fp32, no clipping).
Each optimizer step is timed in two parts, forward + backward and `engine.step()`; the table gives the
mean of each over a whole number of ZenFlow intervals (ZenFlow's host step comes once per interval, so a
median would hide it), and, per mode, the mean whole step. Modes:

- ``sequential``: `offload_optimizer.overlap_step: false`: the host step after the backward, in line.
- ``overlapped``: `offload_optimizer.overlap_step: true` (zerospeed's overlapped CPU step, issue 45).
- ``zenflow_sequential``: `zero_optimization.zenflow` with `overlap_step: false`: the top 5% columns
  stepped at every step, the host step every `--update-interval` steps, in line.
- ``zenflow``: the same with `overlap_step: true`: the host step on a background thread beside the
  following steps' forward and backward, its result published one interval later.

The line "compute + host step in sequence" is the sequential mode's fwd+bwd plus its engine.step: what a
step costs when nothing overlaps. On a CPU-only machine the "device" and the host are the same cores, so
the overlap can win only what the host thread does while the compute thread waits or leaves cores idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import zerospeed
from zerospeed.utils.ports import free_port
from zoo.models import GPT, GPTConfig

MODES = ("sequential", "overlapped", "zenflow_sequential", "zenflow")
VOCAB = 4096


def config(mode: str, args) -> dict:
    zero = {
        "stage": args.stage,
        "reduce_bucket_size": int(args.chunk),
        "allgather_bucket_size": int(args.chunk),
        "sub_group_size": int(args.chunk),
        "offload_optimizer": {"device": "cpu"},
    }
    if mode in ("sequential", "overlapped"):
        zero["offload_optimizer"]["overlap_step"] = mode == "overlapped"
    else:
        zero["zenflow"] = {
            "topk_ratio": 0.05,
            "select_strategy": "step",
            "select_interval": 4 * args.update_interval,
            "update_interval": args.update_interval,
            "overlap_step": mode == "zenflow",
        }
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def run(mode: str, args) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.hidden)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())  # (before ZeRO-3 partitions them to empty placeholders)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config(mode, args))
    g = torch.Generator().manual_seed(1)
    compute, step = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=g)
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            compute.append(t1 - t0)
            step.append(t2 - t1)
    engine.destroy()
    return {"params": n, "compute": statistics.mean(compute), "step": statistics.mean(step), "max_step": max(step)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--chunk", type=float, default=4e6, help="reduce_bucket_size = sub_group_size (elements)")
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16, help="measured steps (a multiple of --update-interval)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured steps (a multiple of --update-interval)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the modes; each mode's fastest is shown")
    args = ap.parse_args(argv)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    zerospeed.init_distributed()
    rows = {}
    for _ in range(args.repeats):  # modes alternate; each keeps its fastest pass (the machine is shared)
        for mode in args.modes.split(","):
            r = run(mode, args)
            if mode not in rows or r["compute"] + r["step"] < rows[mode]["compute"] + rows[mode]["step"]:
                rows[mode] = r
    n = next(iter(rows.values()))["params"]
    print(
        f"ZeRO-{args.stage}, offload_optimizer cpu, fp32 GPT {args.layers}x{args.hidden} (vocab {VOCAB}, "
        f"{n / 1e6:.1f}M parameters), micro batch {args.micro_batch} x {args.seq} tokens, ZenFlow topk 0.05, "
        f"update_interval {args.update_interval}; {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"means of {args.steps} steps after {args.warmup}, fastest of {args.repeats} alternating passes\n"
    )
    print("| mode | fwd+bwd ms | engine.step ms (slowest) | whole step ms | vs sequential |")
    print("|---|---:|---:|---:|---:|")
    base = rows.get("sequential")
    for mode, r in rows.items():
        whole = r["compute"] + r["step"]
        ratio = f"{(base['compute'] + base['step']) / whole:.2f}x" if base else ""
        print(
            f"| {mode} | {r['compute'] * 1e3:.1f} | {r['step'] * 1e3:.1f} ({r['max_step'] * 1e3:.0f}) "
            f"| {whole * 1e3:.1f} | {ratio} |"
        )
    if base:
        print(
            f"\ncompute + host step in sequence (sequential's fwd+bwd + engine.step): "
            f"{(base['compute'] + base['step']) * 1e3:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
