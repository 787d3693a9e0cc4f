"""Train the small byte-level GPT as a pipeline: layers split over stages, 1F1B schedule.

    zerospeed --num_gpus 2 examples/train_gpt_pipe.py --deepspeed examples/configs/gpt_pipe.json

With 2 processes and `--stages 2` each process holds half of the layers (token embedding on the first
stage, output head on the last, their weight tied across the two). With 4 processes and 2 stages the
pipeline is also 2-way data parallel (ZeRO stage 1 inside each stage's data-parallel group).
`gradient_accumulation_steps` is the number of micro-batches per pipeline batch. Nothing is
downloaded: the corpus is the local Python standard library.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import zerospeed
import zerospeed.comm as comm
from zerospeed.monitor.progress import Progress
from zerospeed.pipe import PipelineModule
from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.gpt_layers import gpt_layer_specs, lm_loss
from zoo.models import GPTConfig

logger = logging.getLogger("train_gpt_pipe")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (world size must be a multiple)")
    parser.add_argument("--chunks", type=int, default=1, help="model chunks per stage (>1: interleaved 1F1B)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (pipeline batches)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of stdlib source")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/pipe"))
    zerospeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    zerospeed.init_distributed()
    cfg = GPTConfig(block_size=args.seq_len, n_layer=args.layers, n_head=4, n_embd=128)
    # seed_layers: each layer's initial weights depend only on its index, whatever the stage count
    model = PipelineModule(
        gpt_layer_specs(cfg),
        num_stages=args.stages,
        loss_fn=lm_loss,
        seed_layers=True,
        partition_method="type:PipeBlock",
        chunks=args.chunks,
    )
    dataset = ByteSequenceDataset(stdlib_corpus(args.corpus_bytes), args.seq_len)
    engine, _, _, _ = zerospeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    rank0 = comm.get_rank() == 0
    bar = Progress(args.steps, f"pipe x{args.stages}", enabled=rank0)  # live in a terminal, plain lines in a log
    losses, start = [], time.perf_counter()
    for _ in range(args.steps):
        losses.append(engine.train_batch().item())  # the loss arrives on every stage
        bar.update(f"loss {losses[-1]:.3f} | lr {engine.get_lr()[0]:.2e}")
    bar.close()
    wall = time.perf_counter() - start
    timing, acts = engine.last_batch_timing, engine.activation_stats
    per_stage = comm.all_gather_object(
        {
            "rank": comm.get_rank(),
            "stage": engine.stage_id,
            "layers": model.local_layer_indices(),
            "params": sum(p.numel() for p in model.parameters()),
            "idle_fraction": 1 - timing["compute_s"] / max(timing["wall_s"], 1e-9),
            "peak_activation_bytes": acts["peak_bytes"],
        }
    )
    if rank0:
        summary = {
            "stages": args.stages,
            "world_size": comm.get_world_size(),
            "steps": args.steps,
            "micro_batches": engine.gradient_accumulation_steps(),
            "train_batch_size": engine.train_batch_size(),
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "wall_time_s": wall,
            "tokens_per_s": args.steps * engine.train_batch_size() * args.seq_len / wall,
            "per_rank": per_stage,
            "losses": losses,
        }
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(
            f"\n=== zerospeed pipeline demo: {args.stages} stages x {comm.get_world_size() // args.stages} "
            f"data-parallel ===\nloss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, {wall:.1f} s, "
            f"{summary['tokens_per_s']:,.0f} tokens/s"
        )
        for s in per_stage:
            print(
                f"rank {s['rank']} stage {s['stage']}: layers {s['layers']}, {s['params']:,} params, "
                f"idle {s['idle_fraction']:.0%} of the last batch, peak activations "
                f"{s['peak_activation_bytes'] / 2**20:.1f} MiB"
            )
        print(f"summary          {args.out_dir / 'summary.json'}", flush=True)
    comm.barrier()


if __name__ == "__main__":
    main()
