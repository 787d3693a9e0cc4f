"""The overlapped CPU optimizer against the sequential one (ZeRO-Offload, `offload_optimizer.device: cpu`).

    python benchmarks/offload_overlap.py                         # stage 2, a 60M GPT, 10 measured steps
    python benchmarks/offload_overlap.py --stage 3 --steps 5     # another stage
    python benchmarks/offload_overlap.py --modes sequential,overlapped,zenflow
    python benchmarks/offload_overlap.py --modes sequential,overlapped,delayed

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
- ``delayed``: ``delayed_param_update: true`` (zerospeed's key, no clipping): ZeRO-Offload's one-step
  delayed parameter update, the host step of step t during step t+1's forward and backward, which
  use the parameters of step t-1 (Note [delayed parameter update] in zerospeed/offload/delayed_update.py;
  it changes the numbers, the other modes do not).
- ``zenflow``: DeepSpeed's ``zero_optimization.zenflow`` block with its tutorial's settings, when this
  build accepts it (the row says so when it refuses it).
- ``overlapped_nodefer`` / ``overlapped_clipped_nodefer`` (with ``--stage 3 --offload-param``): the overlap on,
  but ``engine.step()`` waits for every host step, as before the deferred tail (Note [deferred tail] in
  zerospeed/optim/sub_group_step.py; switched off through the stage-3 strategy's internal flag, no config key).

``--offload-param`` (stage 3) adds ``offload_param: {device: cpu}``: there ``engine.step()`` returns while the
last sub-groups' host steps run, and each gather of the next forward waits only for its own sub-group.

The early start has something to overlap only when the model is cut into several reduction units and
sub-groups: ``reduce_bucket_size`` and ``sub_group_size`` are set to ``--chunk`` elements here
(DeepSpeed's defaults, 5e8 and 1e9, leave a model this small one unit, complete at the end of backward).
On a CPU-only machine the "device" is the same cores: the overlapped step wins what the host step's
thread can do while the compute thread works (Note [step threads]).

``--convergence`` measures instead what the delayed parameter update costs in loss: a tiny GPT (1 layer,
32 wide, vocab 256, micro batch 8 x 16 tokens) trained 300 steps at ZeRO-2 with the optimizer offloaded,
with and without ``delayed_param_update`` (warm-up 0 and 40), at several learning rates and seeds: the
mean loss of the last 30 steps.
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

MODES = ("sequential", "overlapped", "sequential_clipped", "overlapped_clipped", "delayed", "zenflow")
NO_DEFER = "_nodefer"


def config(mode: str, args) -> dict:
    mode = mode.removesuffix(NO_DEFER)
    zero = {
        "stage": args.stage,
        "reduce_bucket_size": int(args.chunk),
        "allgather_bucket_size": int(args.chunk),
        "sub_group_size": int(args.chunk),
        "offload_optimizer": {"device": "cpu", "overlap_step": not mode.startswith("sequential")},
    }
    if args.offload_param:
        zero["offload_param"] = {"device": "cpu"}
        zero["stage3_prefetch_bucket_size"] = int(args.chunk)
    if mode == "delayed":
        zero["offload_optimizer"]["delayed_param_update"] = True
    if mode == "zenflow":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["zenflow"] = {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0 if "_clipped" in mode else 0.0,
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
    if mode.endswith(NO_DEFER):
        if not getattr(engine.zero, "_defers", False):
            return "n/a: no deferred tail here (it needs --stage 3 --offload-param)"
        engine.zero._defers = False
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


def convergence(args) -> None:
    """The delayed update's cost in loss (module docstring)."""
    from zoo.data import text_batches

    steps, micro, tail = 300, 8, 30
    data = text_batches(steps, micro, 16)
    print(f"tiny GPT 1 x 32, {steps} steps of {micro} x 16 tokens, AdamW (weight decay 0.01), ZeRO-2 + CPU offload; ")
    print(f"mean loss of the last {tail} steps over seeds {list(range(args.seeds))}\n")
    print("| lr | plain | delayed, no warm-up | delayed, warm-up 40 |")
    print("|---:|---:|---:|---:|")
    for lr in (1e-2, 3e-3, 1e-3):
        cells = []
        for delayed, warm in ((False, 0), (True, 0), (True, 40)):
            tails = []
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=True))
                offload = {"device": "cpu", "delayed_param_update": delayed, "delayed_param_update_warm_up": warm}
                cfg = {
                    "train_micro_batch_size_per_gpu": micro,
                    "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
                    "gradient_clipping": 0.0,
                    "zero_optimization": {"stage": 2, "offload_optimizer": offload},
                    "steps_per_print": 10**9,
                }
                engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                losses = []
                for x, y in data:
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                engine.destroy()
                tails.append(sum(losses[-tail:]) / tail)
            cells.append(sum(tails) / len(tails))
        plain = cells[0]
        print(
            f"| {lr:g} | {plain:.3f} | "
            + " | ".join(f"{c:.3f} ({100 * (c - plain) / plain:+.1f}%)" for c in cells[1:])
            + " |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--chunk", type=float, default=4e6, help="reduce_bucket_size = sub_group_size (elements)")
    ap.add_argument("--offload-param", action="store_true", help="stage 3: offload_param to the CPU as well")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--convergence", action="store_true", help="the delayed update's cost in loss instead")
    ap.add_argument("--seeds", type=int, default=5, help="--convergence: seeds per cell")
    args = ap.parse_args(argv)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    zerospeed.init_distributed()
    if args.convergence:
        convergence(args)
        return 0
    params = " + offload_param cpu" if args.offload_param else ""
    print(
        f"ZeRO-{args.stage}, offload_optimizer cpu{params}, GPT {args.layers}x{args.hidden} (vocab 4096), micro batch "
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
        base = results.get("sequential_clipped" if "_clipped" in mode else "sequential")
        ratio = f"{base['whole'] / r['whole']:.2f}x" if isinstance(base, dict) else ""
        print(f"| {mode} | {r['compute'] * 1e3:.0f} | {r['step'] * 1e3:.0f} | {r['whole'] * 1e3:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
