"""The hybrid engine's generation (runtime/hybrid_engine.py) against plain transformers `generate`.

    .venv/bin/python benchmarks/hybrid_engine.py [--world 2] [--batch 4] [--prompt 32] [--new 32] [--repeats 3]

One Llama (`--hidden`, `--layers`, `--vocab`), greedy, the same prompts for every variant:
- transformers: the whole model's own `generate`, one process (the floor);
- ZeRO-2 hybrid: weights whole on every rank, `engine.generate`;
- ZeRO-3 hybrid, pinned (`pin_parameters`, Note [pinned generation]): every unit gathered once per call;
- ZeRO-3 hybrid, unpinned: the per-module hooks gather every unit for every forward (every token).
Printed per variant: ms per generated token (median over `--repeats` calls, rank 0), gathering collectives
and the bytes they moved per call (the comm gateway's counters), and the ratio to transformers. The
variants must produce transformers' tokens (checked; a mismatch stops the run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64 or 1,
        num_key_value_heads=args.hidden // 64 or 1,
        max_position_embeddings=args.prompt + args.new + 8,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def prompts(args):
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, args.vocab, (args.batch, args.prompt), generator=g)


def timed(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def _variant(args, stage: int, pin: bool):
    import zerospeed
    from zerospeed import comm

    model = build(args)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "pin_parameters": pin},
    }
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    engine.eval()
    ids = prompts(args)

    def call():
        with torch.no_grad():
            return engine.generate(ids, max_new_tokens=args.new, do_sample=False)

    call()  # warm-up (and the recorded fetch order)
    before = comm.STATS.snapshot()
    out, seconds = timed(call, args.repeats)
    after = comm.STATS.snapshot()
    kinds = [k for k in after if "gather" in k]
    calls = sum(after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in kinds) / args.repeats
    nbytes = (
        sum(after[k]["payload_bytes"] - before.get(k, {"payload_bytes": 0})["payload_bytes"] for k in kinds)
        / args.repeats
    )
    return {"tokens": out, "seconds": seconds, "gathers": calls, "gather_bytes": nbytes}


def _all(args):
    return {
        name: _variant(args, stage, pin)
        for name, stage, pin in (
            ("ZeRO-2 hybrid", 2, True),
            ("ZeRO-3 hybrid, pinned", 3, True),
            ("ZeRO-3 hybrid, unpinned", 3, False),
        )
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    from harness import run_distributed

    model = build(args)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.set_num_threads(max(1, torch.get_num_threads() // args.world))  # the ranks' share of the cores
    with torch.no_grad():
        model.generate(prompts(args), max_new_tokens=args.new, do_sample=False)
        want, base = timed(
            lambda: model.generate(prompts(args), max_new_tokens=args.new, do_sample=False), args.repeats
        )
    results = run_distributed(_all, args.world, args, timeout=3600)[0]
    print(
        f"Llama {size / 2**20:.1f} MiB fp32, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.world} ranks (transformers: one process with 1/{args.world} of the threads)\n"
    )
    print("| variant | ms / token | vs transformers | gathering collectives / call | gathered MiB / call |")
    print("|---|---|---|---|---|")
    print(f"| transformers `generate` | {1e3 * base / args.new:.2f} | 1.00 | 0 | 0 |")
    for name, r in results.items():
        if not torch.equal(r["tokens"], want):
            raise SystemExit(f"{name}: tokens differ from transformers'")
        print(
            f"| {name} | {1e3 * r['seconds'] / args.new:.2f} | {r['seconds'] / base:.2f} | {r['gathers']:.0f} | "
            f"{r['gather_bytes'] / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
