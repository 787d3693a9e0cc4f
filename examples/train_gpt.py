"""Train a small byte-level GPT on Python's own standard library, the DeepSpeed way.

    zerospeed --num_gpus 2 examples/train_gpt.py --deepspeed examples/configs/gpt_zero0.json

The script uses only the DeepSpeed-style public API (``zerospeed.initialize``, ``engine(...)``,
``engine.backward``, ``engine.step``) plus ``zerospeed.comm`` for the few collectives it needs to
display numbers, so the same loop runs under DeepSpeed by swapping the import. The corpus is read
from the local Python installation: nothing is downloaded.

On rank 0 it shows a progress bar (loss averaged over ranks, tokens/s, memory per rank; in a file
or CI log, ten plain progress lines instead), writes the loss curve to ``<out-dir>/loss.png`` (the
`plots` extra: matplotlib) and the numbers to ``<out-dir>/summary.json``, and prints a summary at
the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch

import zerospeed
import zerospeed.comm as comm
from zerospeed.accelerator import get_accelerator
from zerospeed.monitor.plot import save_line_plot
from zerospeed.monitor.plot_cli import plot_run
from zerospeed.monitor.progress import Progress
from zerospeed.utils import log_dist
from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.models import GPT, GPTConfig

MODEL_SIZES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
}
DEFAULT_STEPS = 300
MEMORY_EVERY = 10  # gather per-rank memory every N optimizer steps; it costs a collective


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default: the scheduler's total_num_steps, else {DEFAULT_STEPS})",
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    parser.add_argument("--seed", type=int, default=1234, help="model-initialisation seed")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000, help="bytes of stdlib source")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/demo"))
    # What the transformers Trainer would fill into a config's "auto" values (explicit values win):
    parser.add_argument("--micro-batch", type=int, default=8, help='for train_micro_batch_size_per_gpu: "auto"')
    parser.add_argument("--grad-accum", type=int, default=1, help='for gradient_accumulation_steps: "auto"')
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help='for "auto" learning rates, and the AdamW used when the config has no optimizer',
    )
    zerospeed.add_config_arguments(parser)
    return parser.parse_args()


def resolve_steps(args: argparse.Namespace) -> int:
    """--steps, or the length of the LR schedule in the config so the decay ends with the run."""
    config_path = args.deepspeed_config or getattr(args, "deepspeed", None)
    total = None
    if isinstance(config_path, str) and Path(config_path).is_file():
        params = json.loads(Path(config_path).read_text()).get("scheduler", {}).get("params", {})
        total = params.get("total_num_steps")
    if args.steps is None:
        return int(total) if total is not None else DEFAULT_STEPS
    if total is not None and total != args.steps:
        log_dist(
            f"--steps {args.steps} differs from the scheduler's total_num_steps {total}: the learning "
            "rate schedule will not end with the run",
            ranks=[0],
            level=logging.WARNING,
        )
    return args.steps


def resolve_config(args: argparse.Namespace, steps: int, hidden_size: int) -> dict:
    """The --deepspeed config with its "auto" values filled as the transformers Trainer would, from
    this script's flags — so configs written for the Trainer (tutorial ones) train unchanged."""
    from zerospeed.config import load_raw
    from zerospeed.config.auto import auto_values_from_hidden_size, resolve_auto

    raw = load_raw(args.deepspeed_config or args.deepspeed)
    known = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "fp16.enabled": False,
        "bf16.enabled": False,
        "optimizer.params.lr": args.lr,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": args.lr,
        "scheduler.params.warmup_num_steps": max(1, steps // 10),
        "scheduler.params.total_num_steps": steps,
        **auto_values_from_hidden_size(hidden_size),
    }
    return resolve_auto(raw, {k: v for k, v in known.items() if _is_auto(raw, k)})


def _is_auto(raw: dict, dotted: str) -> bool:
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            # a fragment without any batch key (the Trainer supplies them all): fill micro batch and accumulation
            batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
            return dotted in batch_keys[1:] and not any(k in raw for k in batch_keys)
        node = node[part]
    return node == "auto"


def build_model(args: argparse.Namespace) -> GPT:
    # Every rank seeds identically, so all ranks start from the same weights without a broadcast.
    torch.manual_seed(args.seed)
    return GPT(GPTConfig(block_size=args.seq_len, **MODEL_SIZES[args.model_size]))


def memory_per_rank() -> list[int]:
    """Every rank's memory for the progress bar, rank order: CPU resident set, or CUDA peak allocated."""
    acc = get_accelerator()
    return comm.all_gather_object(acc.max_memory_allocated() if acc.name == "cuda" else acc.memory_allocated())


def peak_memory_per_rank() -> list[int]:
    """Every rank's peak memory in bytes (CPU: peak RSS; CUDA: max allocated), rank order."""
    return comm.all_gather_object(get_accelerator().max_memory_allocated())


def fmt_mib(values: list[int]) -> str:
    return " ".join(f"r{r}:{v / 2**20:.0f}M" for r, v in enumerate(values))


def train(engine, loader, steps: int, seq_len: int) -> tuple[list[float], float]:
    """Run ``steps`` optimizer steps; returns the rank-averaged loss of each step and the wall time."""
    device, is_rank0 = engine.device, engine.global_rank == 0
    tokens_per_step = engine.train_batch_size() * seq_len
    bar = Progress(steps, "train", enabled=is_rank0)  # live in a terminal, plain lines in a log
    losses: list[float] = []
    window: list[torch.Tensor] = []
    mem = memory_per_rank()
    start = last = time.perf_counter()
    for x, y in zerospeed.RepeatingLoader(loader):  # endless; each pass is a new shuffled epoch
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()  # ask before step() advances it
        engine.step()
        window.append(loss.detach())
        if not boundary:
            continue
        step_loss = torch.stack(window).mean()
        comm.all_reduce(step_loss, op="avg")
        losses.append(step_loss.item())
        window.clear()
        if engine.global_steps % MEMORY_EVERY == 0:
            mem = memory_per_rank()
        now = time.perf_counter()
        bar.update(
            f"loss {losses[-1]:.3f} | {tokens_per_step / (now - last):,.0f} tok/s | "
            f"lr {engine.get_lr()[0]:.2e} | mem {fmt_mib(mem)}"
        )
        last = now
        if len(losses) >= steps:
            break
    bar.close()
    return losses, time.perf_counter() - start


def report(engine, args, n_params: int, steps: int, losses: list[float], wall: float) -> None:
    """Plot the curve, write summary.json and print the summary (rank 0); gathers on all ranks."""
    peaks = peak_memory_per_rank()
    if engine.global_rank != 0:
        return
    tail = losses[-10:]
    summary = {
        "steps": steps,
        "world_size": engine.world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "model_size": args.model_size,
        "parameters": n_params,
        "seq_len": args.seq_len,
        "train_batch_size": engine.train_batch_size(),
        "micro_batch_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": sum(tail) / len(tail),
        "wall_time_s": wall,
        "tokens_per_s": steps * engine.train_batch_size() * args.seq_len / wall,
        "peak_memory_bytes_per_rank": peaks,
        "device": get_accelerator().name,
        "losses": losses,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_line_plot(
        args.out_dir / "loss.png",
        losses,
        xs=list(range(1, len(losses) + 1)),
        title=f"{args.model_size} GPT, ZeRO stage {summary['zero_stage']}, {engine.world_size} ranks",
        xlabel="optimizer step",
        ylabel="training loss (mean over ranks)",
    )
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary, args.out_dir)
    monitor = engine.config.csv_monitor
    if monitor.enabled:  # the csv monitor's series as PNGs (what `zerospeed-plot RUN_DIR` does)
        plots = plot_run(Path(monitor.output_path) / monitor.job_name)
        print(f"monitor plots    {len(plots)} PNGs in {Path(monitor.output_path) / monitor.job_name}", flush=True)


def print_summary(s: dict, out_dir: Path) -> None:
    mem = fmt_mib(s["peak_memory_bytes_per_rank"])
    print(
        f"\n=== zerospeed demo: {s['model_size']} GPT ({s['parameters']:,} params), ZeRO stage "
        f"{s['zero_stage']}, world size {s['world_size']} ({s['device']}) ===\n"
        f"steps            {s['steps']} (global batch {s['train_batch_size']} = micro "
        f"{s['micro_batch_per_gpu']} x accum {s['gradient_accumulation_steps']} x {s['world_size']} ranks,"
        f" {s['seq_len']} tokens each)\n"
        f"loss             {s['first_loss']:.3f} -> {s['final_loss']:.3f} "
        f"(mean of last 10: {s['final_loss_mean10']:.3f})\n"
        f"wall time        {s['wall_time_s']:.1f} s\n"
        f"throughput       {s['tokens_per_s']:,.0f} tokens/s\n"
        f"peak memory      {mem} (per rank)\n"
        f"loss curve       {out_dir / 'loss.png'}\n",
        flush=True,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    zerospeed.init_distributed()
    if comm.get_rank() == 0:  # the csv monitor appends: start this run's series afresh
        shutil.rmtree(args.out_dir / "monitor", ignore_errors=True)
    comm.barrier()
    steps = resolve_steps(args)
    model = build_model(args)
    dataset = ByteSequenceDataset(stdlib_corpus(args.corpus_bytes), args.seq_len)
    config = resolve_config(args, steps, MODEL_SIZES[args.model_size]["n_embd"])
    engine, _optimizer, loader, _scheduler = zerospeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=dataset,
        config=config,
        optimizer=None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=args.lr),
    )
    losses, wall = train(engine, loader, steps, args.seq_len)
    engine.destroy()
    report(engine, args, sum(zerospeed.zero.full_numel(p) for p in model.parameters()), steps, losses, wall)
    comm.barrier()


if __name__ == "__main__":
    main()
