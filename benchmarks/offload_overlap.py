"""The overlapped CPU optimizer against the sequential one (ZeRO-Offload, `offload_optimizer.device: cpu`).

    python benchmarks/offload_overlap.py                         # stage 2, a 60M GPT, 10 measured steps
    python benchmarks/offload_overlap.py --stage 3 --steps 5     # another stage
    python benchmarks/offload_overlap.py --modes sequential,overlapped,zenflow

One process (a world of one, gloo), one engine per mode, the same GPT, data and AdamW; the engines take
their steps in turn (round-robin), so drifting load on shared cores weighs on every mode alike. Each
optimizer step is timed in two parts: forward + backward (`engine.backward` returns: the gradients are
reduced) and `engine.step()`; the table gives their medians and the median whole step. Modes:

- ``sequential``: ``overlap_step: false``, today's step: the host step of every sub-group after the
  whole backward, then the copy back.
- ``overlapped``: ``overlap_step: true`` (the default) without clipping: each sub-group's host step
  starts on the worker thread as soon as the backward has delivered its gradients (Note [overlapped
  step] in zerospeed/optim/sub_group_step.py).
- ``sequential_clipped`` / ``overlapped_clipped``: both with ``gradient_clipping: 1.0``: the
  coefficient needs the global norm, so the steps start at ``engine.step()`` and only the copy back
  overlaps (on a CPU-only machine there is no copy back: the step runs inline, as the sequential one).
- ``zenflow``: DeepSpeed's ``zero_optimization.zenflow`` block with its tutorial's settings, when this
  build accepts it (the row says so when it refuses it).

The early start has something to overlap only when the model is cut into several reduction units and
sub-groups: ``reduce_bucket_size`` and ``sub_group_size`` are set to ``--chunk`` elements here
(DeepSpeed's defaults, 5e8 and 1e9, leave a model this small one unit, complete at the end of backward).
On a CPU-only machine the "device" is the same cores: the overlapped step wins what the host step's
thread can do while the compute thread works (Note [step threads]).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import zerospeed
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.ports import free_port
from zoo.models import GPT, GPTConfig

MODES = ("sequential", "overlapped", "sequential_clipped", "overlapped_clipped", "zenflow")


def config(mode: str, args) -> dict:
    zero = {
        "stage": args.stage,
        "reduce_bucket_size": int(args.chunk),
        "allgather_bucket_size": int(args.chunk),
        "sub_group_size": int(args.chunk),
        "offload_optimizer": {"device": "cpu", "overlap_step": not mode.startswith("sequential")},
    }
    if mode == "zenflow":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["zenflow"] = {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0 if mode.endswith("_clipped") else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def build(mode: str, args):
    """The engine of `mode`, or why this build refuses its config."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.hidden))
    try:
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config(mode, args))
    except ConfigError as err:
        return f"refused: {str(err).splitlines()[0]}"
    return engine


def one_step(engine, x: torch.Tensor) -> tuple[float, float]:
    """(forward + backward, engine.step()) seconds of one optimizer step."""
    t0 = time.perf_counter()
    engine.backward(engine(x, x))
    t1 = time.perf_counter()
    engine.step()
    return t1 - t0, time.perf_counter() - t1


def run_all(modes: list[str], args) -> dict:
    """Every mode's engine built first, then the steps taken round-robin (mode after mode, step after
    step), so a machine whose load drifts (shared cores) weighs on every mode alike."""
    engines = {m: build(m, args) for m in modes}
    live = {m: e for m, e in engines.items() if not isinstance(e, str)}
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in live}
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, 4096, (args.micro_batch, args.seq), generator=g)
        for m, engine in live.items():
            t = one_step(engine, x)
            if i >= args.warmup:
                times[m].append(t)
    out = {m: e for m, e in engines.items() if isinstance(e, str)}
    for m, engine in live.items():
        compute, step = (statistics.median(v) for v in zip(*times[m]))
        out[m] = {"compute": compute, "step": step, "whole": statistics.median(a + b for a, b in times[m])}
        engine.destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--chunk", type=float, default=4e6, help="reduce_bucket_size = sub_group_size (elements)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    zerospeed.init_distributed()
    print(
        f"ZeRO-{args.stage}, offload_optimizer cpu, GPT {args.layers}x{args.hidden} (vocab 4096), micro batch "
        f"{args.micro_batch} x {args.seq} tokens, reduce_bucket_size = sub_group_size = {int(args.chunk):,}; "
        f"{os.cpu_count()} cores, torch.get_num_threads() {torch.get_num_threads()}; medians of {args.steps} steps\n"
    )
    print("| mode | fwd+bwd ms | engine.step ms | whole step ms | vs sequential (same clipping) |")
    print("|---|---:|---:|---:|---:|")
    modes = args.modes.split(",")
    results = run_all(modes, args)
    for mode in modes:
        r = results[mode]
        if isinstance(r, str):
            print(f"| {mode} | | | | {r} |")
            continue
        base = results.get("sequential_clipped" if mode.endswith("_clipped") else "sequential")
        ratio = f"{base['whole'] / r['whole']:.2f}x" if isinstance(base, dict) else ""
        print(f"| {mode} | {r['compute'] * 1e3:.0f} | {r['step'] * 1e3:.0f} | {r['whole'] * 1e3:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
