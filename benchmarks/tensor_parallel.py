"""Tensor parallelism on this machine: step time, parameter bytes and bytes moved per rank, for one
plain process, PyTorch DDP on 2 ranks, zerospeed data parallel on 2 ranks and zerospeed AutoTP tp = 2.

    python benchmarks/tensor_parallel.py [--layers 4 --width 256 --heads 8 --vocab 8192 --seq 256
                                          --micro 4 --steps 6]

One invocation prints a markdown table. Model: a transformers Llama built from a config (fp32, sdpa,
no dropout), trained with AdamW on fixed-seed token batches; every variant runs the same global batch
per step (2 x micro sequences): the single process takes it whole, the dp variants one micro-batch per
rank, the tp variant the whole batch on both ranks (tensor-parallel ranks read the same data).

- step s: the median over the measured steps (after one warm-up) of the slowest rank's wall time for
  forward + backward + optimizer step.
- param MiB / rank: the bytes of the parameters each rank holds (the census of `model.parameters()`).
- comm MiB / rank / step: the payload the zerospeed gateway counted (`comm.STATS`) per step; DDP's
  bucketed all-reduce payload is the parameter bytes (not counted by the gateway, shown as such).
- ratios: step time against one process and against DDP.

On this 2-core machine two ranks share the two cores, so tp = 2 shows its overheads (two all-reduces of
the activations per block and direction) rather than a speed-up; the memory column shows what it buys.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def _batches(args):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (2 * args.micro, args.seq), generator=g) for _ in range(args.steps + 1)]


def _param_mib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def _timed(step_fn, batches, barrier=None) -> list[float]:
    times = []
    for ids in batches:
        if barrier:
            barrier()
        start = time.perf_counter()
        step_fn(ids)
        times.append(time.perf_counter() - start)
    return times[1:]


def _single(args):
    torch.set_num_threads(os.cpu_count() or 1)
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return {"step": statistics.median(_timed(step, _batches(args))), "param_mib": _param_mib(model), "comm_mib": 0.0}


def _ddp(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = _model(args)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank = dist.get_rank()

    def step(ids):
        mine = ids[rank * args.micro : (rank + 1) * args.micro]
        ddp(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()

    times = _timed(step, _batches(args), dist.barrier)
    return {"step": times, "param_mib": _param_mib(model), "comm_mib": _param_mib(model)}


def _zerospeed(args, tp: int):
    import zerospeed
    from zerospeed import comm

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = _model(args)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro * (2 if tp > 1 else 1),
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dp_rank = engine.mesh.rank_in("dp")

    def step(ids):
        mine = ids if tp > 1 else ids[dp_rank * args.micro : (dp_rank + 1) * args.micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()

    batches = _batches(args)
    step(batches[0])
    comm.STATS.reset()
    times = _timed(step, batches, comm.barrier)
    moved = sum(k["payload_bytes"] for k in comm.STATS.snapshot().values()) / len(batches) / 2**20
    return {"step": times, "param_mib": _param_mib(engine.module), "comm_mib": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from harness import run_distributed

    def slowest(results):
        per_step = [max(r["step"][i] for r in results) for i in range(len(results[0]["step"]))]
        return {**results[0], "step": statistics.median(per_step)}

    rows = {
        "one process (plain PyTorch)": run_distributed(_single, 1, args, timeout=3600)[0],
        "PyTorch DDP, dp = 2": slowest(run_distributed(_ddp, 2, args, timeout=3600)),
        "zerospeed, dp = 2 (ZeRO-0)": slowest(run_distributed(_zerospeed, 2, args, 1, timeout=3600)),
        "zerospeed AutoTP, tp = 2": slowest(run_distributed(_zerospeed, 2, args, 2, timeout=3600)),
    }
    one, ddp = rows["one process (plain PyTorch)"]["step"], rows["PyTorch DDP, dp = 2"]["step"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; Llama {args.layers} layers x {args.width}, "
        f"{args.heads} heads, vocab {args.vocab}, seq {args.seq}, global batch {2 * args.micro}, fp32, AdamW\n"
    )
    print("| variant | step s | vs one process | vs DDP | param MiB / rank | comm MiB / rank / step |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['step']:.3f} | {r['step'] / one:.2f} | {r['step'] / ddp:.2f} | {r['param_mib']:.1f} | "
            f"{r['comm_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()
