"""Convergence of the compressed trainings over several seeds: is a compressed run's gap to its
uncompressed counterpart the compression's, or the spread one run has anyway?

    python benchmarks/compression_convergence.py --family onebit [--seeds 0 1 2 --steps 300]
    python benchmarks/compression_convergence.py --family zeropp [--seeds 0 1 2 --steps 300]

The settings are those of the suite's convergence tests (tests/dist/test_onebit.py and
tests/dist/test_zeropp.py): the demo GPT, fp32.
- onebit (2 ranks, micro-batch 4, ZeRO-0): Adam / OneBitAdam (freeze_step 60) / ZeroOneAdam
  (var_freeze_step 100, var_update_scaler 64, local_step_clipper 1), Lamb / OneBitLamb (freeze_step 150).
- zeropp (4 ranks, micro-batch 2, stage 3, AdamW lr 3e-3, clipping 1.0): plain ZeRO-3, qwZ, qgZ, all
  three (hpZ over 2 ranks). hpZ alone changes no value (the suite checks it equals plain exactly).

A seed fixes the model's initialisation and the order of the training windows (seed 0: the corpus in
order, as in the tests; seed s > 0: a permutation of the same windows drawn with s). Every run of one seed
sees the same batches. "final" is the mean of the last 20 rank-mean step losses. For each compressed run:
its gap to the counterpart per seed, and the mean and sample standard deviation of the gaps over seeds;
for the counterparts, their own spread over seeds (how much one run moves anyway).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import zerospeed
from harness import run_distributed
from harness.reference import engine_global_step
from zerospeed import comm
from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.models import GPT, GPTConfig

ONEBIT_MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
ZEROPP_MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
ONEBIT_RUNS = {  # name: (optimizer type, params, counterpart)
    "Adam": ("Adam", {"lr": 1e-3}, None),
    "OneBitAdam": ("OneBitAdam", {"lr": 1e-3, "freeze_step": 60}, "Adam"),
    "ZeroOneAdam": (
        "ZeroOneAdam",
        {"lr": 1e-3, "var_freeze_step": 100, "var_update_scaler": 64, "local_step_clipper": 1},
        "Adam",
    ),
    "Lamb": ("Lamb", {"lr": 1e-2}, None),
    "OneBitLamb": ("OneBitLamb", {"lr": 1e-2, "freeze_step": 150}, "Lamb"),
}
ZEROPP_RUNS = {  # name: (zero_optimization switches, counterpart)
    "plain ZeRO-3": ({}, None),
    "qwZ": ({"zero_quantized_weights": True}, "plain ZeRO-3"),
    "qgZ": ({"zero_quantized_gradients": True}, "plain ZeRO-3"),
    "all three": (
        {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
        "plain ZeRO-3",
    ),
}
FAMILIES = {"onebit": (ONEBIT_RUNS, 2, 4, ONEBIT_MODEL), "zeropp": (ZEROPP_RUNS, 4, 2, ZEROPP_MODEL)}


def window_order(seed: int, count: int) -> torch.Tensor:
    return torch.arange(count) if seed == 0 else torch.randperm(count, generator=torch.Generator().manual_seed(seed))


def engine_config(family: str, name: str, micro: int) -> dict:
    if family == "onebit":
        opt_type, params, _ = ONEBIT_RUNS[name]
        return {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": opt_type, "params": params}}
    switches, _ = ZEROPP_RUNS[name]
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "overlap_comm": True,
            "stage3_max_reuse_distance": 0,
            **switches,
        },
    }


def train(family: str, name: str, seed: int, steps: int) -> list[float]:
    """Rank-mean losses of `steps` steps; rank r takes windows r*micro .. of each global batch."""
    runs, _, micro, model_cfg = FAMILIES[family]
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    engine, *_ = zerospeed.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(family, name, micro)
    )
    ds = ByteSequenceDataset(
        stdlib_corpus(max_bytes=steps * world * micro * model_cfg.block_size + 1), model_cfg.block_size
    )
    order, n = window_order(seed, len(ds)), world * micro
    losses = []
    for step in range(steps):
        windows = [ds[int(order[(step * n + i) % len(ds)])] for i in range(n)]
        batch = torch.stack([x for x, _ in windows]), torch.stack([y for _, y in windows])
        losses.append(engine_global_step(engine, batch, world, 1, rank))
    zero = getattr(engine, "zero", None)
    if hasattr(zero, "remove_hooks"):
        zero.remove_hooks()
    return losses


def job(family: str, seeds: list[int], steps: int) -> dict:
    return {(name, seed): train(family, name, seed, steps) for seed in seeds for name in FAMILIES[family][0]}


def final(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20


def report(family: str, seeds: list[int], runs: dict, seconds: float, steps: int) -> str:
    table, world = FAMILIES[family][0], FAMILIES[family][1]
    counterpart = {name: spec[-1] for name, spec in table.items()}
    lines = [
        f"{family}: {world} ranks, {steps} steps, seeds {seeds}, {seconds:.0f} s; "
        f"{platform.processor() or platform.machine()}",
        "",
        "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gap | std of gap |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for name, base in counterpart.items():
        finals = [final(runs[name, s]) for s in seeds]
        if base is None:
            spread = statistics.stdev(finals) / statistics.mean(finals) if len(seeds) > 1 else 0.0
            cells = " | ".join(f"{v:.3f}" for v in finals)
            lines.append(f"| {name} | {cells} | (own spread over seeds: {spread:.1%}) | |")
            continue
        gaps = [final(runs[name, s]) / final(runs[base, s]) - 1 for s in seeds]
        cells = " | ".join(f"{v:.3f} ({g:+.1%})" for v, g in zip(finals, gaps, strict=True))
        std = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        lines.append(f"| {name} | {cells} | {statistics.mean(gaps):+.2%} | {std:.2%} |")
    bad = [k for k, losses in runs.items() if not all(torch.isfinite(torch.tensor(losses))) or min(losses) <= 0]
    lines += ["", f"NaN / inf / zero losses: {bad or 'none'}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    world = FAMILIES[args.family][1]
    start = time.perf_counter()
    runs = run_distributed(job, world, args.family, args.seeds, args.steps, timeout=3600)[0]
    print(report(args.family, args.seeds, runs, time.perf_counter() - start, args.steps))


if __name__ == "__main__":
    main()
