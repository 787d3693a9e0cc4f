"""Mixture of Experts on this machine: an MoE GPT against a dense GPT with the same active parameters per
token, and tokens/s against the expert-parallel degree.

    python benchmarks/moe.py [--layers 2 --width 128 --experts 4 --seq 128 --micro 4 --steps 6 --eps 1,2,4]

One invocation prints a markdown table. The models are pre-LN GPT blocks (SDPA causal attention); the
dense one has a 4h MLP per block, the MoE one `zerospeed.moe.layer.MoE(expert=<the same 4h MLP>,
num_experts=E, k=1)` in its place — so each token meets the same number of weights (active parameters
equal) while the model holds E times the MLP weights. fp32, AdamW, loss = LM loss + 0.01 l_aux.

- dense, one process: plain PyTorch. MoE, ep = P: P processes through `zerospeed.initialize` (ZeRO-0,
  every rank data parallel for the dense weights, experts split P ways), each rank its own micro-batch,
  so the global batch grows with P (tokens/s is per the whole job).
- step s: median over the measured steps (after one warm-up) of the slowest rank; tokens/s = global
  tokens / step s; param MiB / rank: the census of the rank's parameters; all-to-all MiB / rank / step:
  `comm.STATS` payload of kind all_to_all.

On this 2-core machine ep = 4 runs 4 processes on 2 cores: its tokens/s measures overhead, not scaling.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn = ffn

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))
        out = self.ffn(self.ln2(x))
        if isinstance(out, tuple):  # MoE: (output, l_aux, exp_counts)
            return x + out[0], out[1]
        return x + out, x.new_zeros(())


class GPT(nn.Module):
    def __init__(self, args, moe_ep: int | None):
        super().__init__()
        from zerospeed.moe.layer import MoE

        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(args.vocab, args.width), nn.Embedding(args.seq, args.width)
        ffn = (
            (lambda: MLP(args.width))
            if moe_ep is None
            else (lambda: MoE(args.width, MLP(args.width), num_experts=args.experts, ep_size=moe_ep, k=1))
        )
        self.blocks = nn.ModuleList(Block(args.width, 4, ffn()) for _ in range(args.layers))
        self.head = nn.Linear(args.width, args.vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)) + 0.01 * aux


def _batches(args, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, args.vocab, (args.micro, args.seq), generator=g) for _ in range(args.steps + 1)]


def _mib(params) -> float:
    return sum(p.numel() * p.element_size() for p in params) / 2**20


def _dense(args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    model = GPT(args, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for ids in _batches(args, 0):
        start = time.perf_counter()
        model(ids).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step": times[1:], "param_mib": _mib(model.parameters()), "a2a_mib": 0.0, "ranks": 1}


def _moe(args, ep: int):
    import zerospeed
    from zerospeed import comm
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world = comm.get_world_size() if comm.is_initialized() else 1
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = GPT(args, ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg)
    batches = _batches(args, comm.get_rank())
    times = []
    for i, ids in enumerate(batches):
        if i == 1:
            comm.STATS.reset()
        comm.barrier()
        start = time.perf_counter()
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    a2a = comm.STATS.snapshot().get("all_to_all", {}).get("payload_bytes", 0) / args.steps / 2**20
    return {"step": times[1:], "param_mib": _mib(model.parameters()), "a2a_mib": a2a, "ranks": comm.get_world_size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eps", default="1,2,4")
    args = parser.parse_args()
    from harness import run_distributed

    def slowest(results):
        per_step = [max(r["step"][i] for r in results) for i in range(len(results[0]["step"]))]
        return {**results[0], "step": statistics.median(per_step)}

    rows = {"dense GPT, one process (plain PyTorch)": slowest(run_distributed(_dense, 1, args, timeout=3600))}
    for ep in (int(e) for e in args.eps.split(",")):
        rows[f"MoE GPT ({args.experts} experts, top-1), ep = {ep}"] = slowest(
            run_distributed(_moe, ep, args, ep, timeout=3600)
        )
    dense = rows["dense GPT, one process (plain PyTorch)"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; GPT {args.layers} layers x {args.width}, "
        f"vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro} per rank, fp32, AdamW\n"
    )
    print("| model | ranks | step s | tokens/s | tokens/s vs dense | param MiB / rank | all-to-all MiB / rank / step |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        tps = r["ranks"] * args.micro * args.seq / r["step"]
        dense_tps = args.micro * args.seq / dense["step"]
        print(
            f"| {name} | {r['ranks']} | {r['step']:.3f} | {tps:.0f} | {tps / dense_tps:.2f} | {r['param_mib']:.2f} | "
            f"{r['a2a_mib']:.2f} |"
        )


if __name__ == "__main__":
    main()
