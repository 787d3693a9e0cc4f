"""Ulysses sequence parallelism on this machine: activation memory per rank, the longest sequence that
fits a memory budget, and step time vs sequence length, for sp = 1, 2, 4 (gloo processes).

    python benchmarks/sequence_parallel.py [--seqs 1024,2048,4096 --census-seqs 4096,8192,16384
                                            --width 64 --heads 8 --layers 2 --vocab 8192 --budget-mib 1024]

One invocation prints markdown tables. The model is zoo.sequence_models.GPT (pre-LN
blocks, SDPA causal attention), batch 1, fp32; sp = 1 is one plain process (no zerospeed code runs in
its forward), sp = P is P gloo ranks with DistributedAttention.

- activation MiB / rank: the distinct storages autograd saves during one forward (parameters
  excluded) — an independent census of what the backward keeps — at --census-seqs, with the loss
  computed two ways: from the full [s/P, vocab] logits, and tiled (`tiled_cross_entropy_sum`, 8 tiles:
  the logits never exist whole). "logits MiB" is the size of the full-logits tensor of a rank.
- longest sequence in budget: --budget-mib divided by the per-token census slope (tiled loss), i.e. the
  sequence whose saved activations per rank fill the budget.
- step time: median of 3 forward + backward passes (after one warm-up) per rank, at --seqs. On this
  2-core machine P processes share 2 cores, so sp = 4 measures overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def _saved_bytes(fn, params) -> int:
    import torch

    ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _case(args, sp: int):
    """Run on every rank (or alone at sp = 1): {seq: {...}} for this rank."""
    import torch

    from zerospeed import comm
    from zerospeed.comm.mesh import ParallelMesh
    from zerospeed.sequence.layer import DistributedAttention
    from zerospeed.sequence.loss import mean_over_sequence
    from zerospeed.sequence.tiled import tiled_cross_entropy_sum
    from zoo.sequence_models import GPT, local_sdpa

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))
    group, rank = None, 0
    attention = local_sdpa
    if sp > 1:
        mesh = ParallelMesh.build(sp=sp)
        group, rank = mesh.group("sp"), mesh.rank_in("sp")
        dist_attn = DistributedAttention(local_sdpa, group)
        attention = lambda q, k, v: dist_attn(q, k, v, batch_dim_idx=0)  # noqa: E731
    longest = max(args.census_seqs + args.seqs)
    torch.manual_seed(0)
    model = GPT(args.width, args.heads, args.heads, attention, layers=args.layers, max_pos=longest, vocab=args.vocab)
    params = list(model.parameters())
    out = {}
    for seq in sorted(set(args.census_seqs + args.seqs)):
        local = seq // sp
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, args.vocab, (1, local), generator=g)
        labels = torch.randint(0, args.vocab, (1, local), generator=g)
        pos = torch.arange(rank * local, (rank + 1) * local).unsqueeze(0)

        def full_loss():
            logits = model.logits(ids, pos)
            s = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1), reduction="sum")
            return mean_over_sequence(s, labels.numel(), group)

        def tiled_loss():
            s = tiled_cross_entropy_sum(model.hidden(ids, pos), model.head.weight, labels, shards=8)
            return mean_over_sequence(s, labels.numel(), group)

        row = {"logits_mib": local * args.vocab * 4 / 2**20}
        if seq in args.census_seqs:
            row["full_mib"] = _saved_bytes(full_loss, params)[0] / 2**20
            row["tiled_mib"] = _saved_bytes(tiled_loss, params)[0] / 2**20
        if seq in args.seqs:
            times = []
            for _i in range(4):
                comm.barrier(group) if sp > 1 else None
                start = time.perf_counter()
                tiled_loss().backward()
                times.append(time.perf_counter() - start)
            row["step_s"] = statistics.median(times[1:])
        out[seq] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--census-seqs", default="4096,8192,16384")
    parser.add_argument("--sps", default="1,2,4")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    args = parser.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.census_seqs = [int(s) for s in args.census_seqs.split(",")]
    sps = [int(s) for s in args.sps.split(",")]

    from harness import run_distributed

    results = {}
    for sp in sps:
        results[sp] = run_distributed(_case, sp, args, sp, timeout=1800)[0]  # sp = 1 too: same process setup

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch gloo; model: GPT width {args.width}, "
        f"{args.heads} heads, {args.layers} layers, vocab {args.vocab}, batch 1, fp32\n"
    )
    print(
        "| seq | sp | logits MiB / rank | activations MiB / rank (full logits) | activations MiB / rank (tiled loss) |"
    )
    print("|---|---|---|---|---|")
    for seq in args.census_seqs:
        for sp in sps:
            r = results[sp][seq]
            print(f"| {seq} | {sp} | {r['logits_mib']:.1f} | {r['full_mib']:.1f} | {r['tiled_mib']:.1f} |")
    print(f"\n| sp | activation bytes / token / rank (tiled) | longest sequence in {args.budget_mib:.0f} MiB / rank |")
    print("|---|---|---|")
    a, b = args.census_seqs[0], args.census_seqs[-1]
    for sp in sps:
        slope = (results[sp][b]["tiled_mib"] - results[sp][a]["tiled_mib"]) * 2**20 / (b - a)
        print(f"| {sp} | {slope:.0f} | {int(args.budget_mib * 2**20 / slope) // 1024 * 1024} |")
    print(
        "\n| seq | "
        + " | ".join(f"sp={sp} step s" for sp in sps)
        + " | "
        + " | ".join(f"sp={sp} / sp=1" for sp in sps[1:])
        + " |"
    )
    print("|---|" + "---|" * (2 * len(sps) - 1))
    for seq in args.seqs:
        steps = [results[sp][seq]["step_s"] for sp in sps]
        ratios = [s / steps[0] for s in steps[1:]]
        print(
            f"| {seq} | "
            + " | ".join(f"{s:.3f}" for s in steps)
            + " | "
            + " | ".join(f"{r:.2f}" for r in ratios)
            + " |"
        )


if __name__ == "__main__":
    main()
