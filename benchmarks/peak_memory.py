"""Peak host memory per rank and per phase at ZeRO stages 0-3, the DeepSpeed user's GPT-2 run.

    python benchmarks/peak_memory.py [--stages 0 1 2 3] [--dtypes fp32 bf16] [--offload] [--steps 4]
                                     [--zero-init] [--no-allocated]

transformers GPT-2 (`GPT2Config(n_layer=12, n_embd=768, n_head=12)`, dropout 0, built without
zero.Init), 2 ranks, micro batch 4 x 128 tokens, AdamW, DeepSpeed's defaults for every other key.
The peaks are the kernel's high-water mark of each rank's resident set per phase of every step
(`"memory_breakdown": true`, zerospeed/profiling/memory_phases.py); "states" is an independent census
of live tensor storages after the last step (harness.census), "base" the resident set
before the model was built. With `--offload` the optimizer (stages 1-3) is offloaded to the CPU:
on a CPU-only machine that memory is the same host memory, so only the machinery's overhead shows.

"predicted" is the estimator's peak (`zerospeed.estimate.peak`, allocated bytes, gloo) and
"allocated" the measured one it predicts: the torch profiler's allocator record of the steady steps
(`harness.alloc_peak`, independent of zerospeed); the resident-set columns add the host
allocator's share and the process's base on top.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

MIB = 1 << 20


def run(stage: int, dtype: str, steps: int, offload: bool, allocated: bool = True, zero_init: bool = False) -> dict:
    import torch
    import transformers

    import zerospeed
    from harness import census
    from harness.alloc_peak import AllocationTrace
    from zerospeed.accelerator import get_accelerator

    # the profiler's allocator record slows the step: --no-allocated for step times
    trace = AllocationTrace().__enter__() if allocated else None
    base = get_accelerator().memory_allocated()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    zero = {"stage": stage}
    if offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "memory_breakdown": True,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    # --zero-init: built under zero.Init (stage 3), each rank never holding the whole model
    with trace.window("build") if trace else contextlib.nullcontext():
        with zerospeed.zero.Init(config_dict_or_path=ds) if zero_init else contextlib.nullcontext():
            model = transformers.GPT2LMHeadModel(cfg)
        params = sum(zerospeed.zero.stage3.full_numel(p) for p in model.parameters())
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    del model
    phases = engine.observer.memory_phases
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    times = []
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (4, 128), generator=g)
        t = time.perf_counter()
        with trace.window("steady" if step else "first") if trace else contextlib.nullcontext():
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t)
        if step == 0:
            phases.reset()  # the first step allocates the optimizer states: report the steady steps
    if trace:
        trace.__exit__(None, None, None)
    return {
        "params": params,
        "base": base,
        "peak": dict(phases.peak),
        "start": dict(phases.start),
        "states": census.live_tensor_bytes(),
        "step_s": sorted(times[1:])[len(times[1:]) // 2],
        "allocated": trace.peak("steady") if trace else 0,
        "build": trace.peak("build") if trace else 0,
        "after_build": trace.at_start("first") if trace else 0,
    }


def predicted(stage: int, dtype: str, offload: bool) -> float:
    """The estimator's peak for this run (2 ranks, gloo), bytes per rank."""
    from zerospeed.estimate import Option, Precision, Workload, peak_terms
    from zerospeed.estimate.census import census_of_config
    from zerospeed.estimate.peak import EngineKnobs

    shape = census_of_config(
        {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    ).shape
    option = Option(stage, offload_optimizer=offload and stage > 0)
    prec = Precision.of(dtype, "adamw", "fp32")
    return peak_terms(
        shape,
        2,
        option,
        prec,
        Workload(4, 128, act_bytes=4 if dtype == "fp32" else 2, mlp_activation="gelu_new", loss_upcast=True),
        EngineKnobs(),
    ).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument(
        "--zero-init",
        action="store_true",
        help="build the model under zero.Init (stage 3 only); prints the build + initialize peak",
    )
    parser.add_argument(
        "--no-allocated",
        dest="allocated",
        action="store_false",
        help="skip the profiler's allocator record (it slows the step): for step times",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    from harness import run_distributed

    print(
        "| dtype | stage | offload | params | peak MiB/rank | forward | backward | reduce | step | states MiB "
        "| base MiB | step s | predicted MiB | allocated MiB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes:
        for stage in args.stages:
            if args.zero_init and stage != 3:
                continue
            ranks = run_distributed(
                run, 2, stage, dtype, args.steps, args.offload, args.allocated, args.zero_init, timeout=1200
            )
            r = max(ranks, key=lambda r: max(r["peak"].values()))
            cols = [f"{r['peak'].get(p, 0) / MIB:,.0f}" for p in ("forward", "backward", "reduce", "step")]
            print(
                f"| {dtype} | {stage} | {'cpu' if args.offload and stage else '-'} | {r['params']:,} "
                f"| **{max(r['peak'].values()) / MIB:,.0f}** | {' | '.join(cols)} | {r['states'] / MIB:,.0f} "
                f"| {r['base'] / MIB:,.0f} | {r['step_s']:.2f} "
                f"| {predicted(stage, dtype, args.offload) / MIB:,.0f} "
                f"| {max(x['allocated'] for x in ranks) / MIB:,.0f} |",
                flush=True,
            )
            if args.allocated:
                full = r["params"] * (4 if dtype == "fp32" else 2)
                build = ", ".join(f"{x['build'] / MIB:,.0f}" for x in ranks)
                after = ", ".join(f"{x['after_build'] / MIB:,.0f}" for x in ranks)
                print(
                    f"  build + initialize{' under zero.Init' if args.zero_init else ''}: allocated peak {build} "
                    f"MiB per rank, {after} after; the whole model is {full / MIB:,.0f} MiB",
                    flush=True,
                )


if __name__ == "__main__":
    main()
