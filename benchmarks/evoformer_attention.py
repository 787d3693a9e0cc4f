"""DS4Sci_EvoformerAttention (zerospeed/ops/evoformer.py) against the naive attention: memory, time, accuracy.

    python benchmarks/evoformer_attention.py [--lengths 256,512,1024 --rows 16 --heads 4 --dim 32 --repeats 3]
                                             [--no-deepspeed-shapes] [--threads 2]

Two markdown tables.

1. Memory and time against L (fp32, q, k, v ``[1, rows, L, heads, dim]``, both biases: the fp32 key mask
   ``-1e9 * (mask == 0)`` ``[1, rows, 1, 1, L]`` without gradient, the pair bias ``[1, 1, heads, L, L]`` with
   one). "naive" is softmax(q k^T / sqrt(D) + bias1 + bias2) v with the logits written out (DeepSpeed's and
   OpenFold's reference), under autograd. "peak MiB": the largest sum of live allocations during one forward +
   backward above what was live before it (the torch profiler's allocator record, `harness.alloc_peak`, the
   number a GPU's max_memory_allocated reports), inputs excluded, gradients included. "saved MiB": the
   bytes autograd keeps between forward and backward (saved tensors, deduplicated by storage, the inputs
   included). "time": the median wall time of --repeats forward + backward runs after one warm-up.
2. DeepSpeed's test shapes (1, 256, 256, 4, 32) and (1, 512, 256, 8, 8) in bf16 and fp16 with DeepSpeed's
   inputs (randn, mask bias 1e9 * (mask - 1), -inf in fp16; grad_out rand): the max-abs error of O, dQ, dK,
   dV, dBias1, dBias2 against a float64 naive reference (computed 16 MSA rows at a time so that it fits),
   and zerospeed's forward + backward time and allocated peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from harness.alloc_peak import AllocationTrace  # noqa: E402
from zerospeed.ops.deepspeed4science import DS4Sci_EvoformerAttention  # noqa: E402

MIB = 2**20


def naive(q, k, v, biases):
    s = torch.einsum("bnqhd,bnkhd->bnhqk", q, k) / math.sqrt(q.shape[-1])
    for b in biases:
        if b is not None:
            s = s + b
    return torch.einsum("bnhqk,bnkhd->bnqhd", torch.softmax(s, -1), v)


def ours(q, k, v, biases):
    return DS4Sci_EvoformerAttention(q, k, v, biases)


def make_inputs(shape, dtype, seed=0, deepspeed_mask=True):
    g = torch.Generator().manual_seed(seed)
    B, N, L, H, D = shape
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.randint(0, 2, (B, N, 1, 1, L), generator=g).to(dtype)
    bias1 = 1e9 * (mask - 1) if deepspeed_mask else torch.where(mask == 0, -1e9, 0.0).to(dtype)
    bias2 = torch.randn(B, 1, H, L, L, generator=g).to(dtype).requires_grad_()
    return q, k, v, bias1, bias2


def fwd_bwd(fn, q, k, v, bias1, bias2, grad_out):
    out = fn(q, k, v, [bias1, bias2])
    grads = torch.autograd.grad(out, (q, k, v, bias2), grad_out)
    return out, grads


def peak_mib(fn, tensors, grad_out) -> float:
    with AllocationTrace() as trace, trace.window("step"):
        result = fwd_bwd(fn, *tensors, grad_out)
        del result
    return (trace.peak("step") - trace.at_start("step")) / MIB


def saved_mib(fn, tensors) -> float:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*tensors[:3], list(tensors[3:]))
    del out
    return sum(storages.values()) / MIB


def time_s(fn, tensors, grad_out, repeats: int) -> float:
    fwd_bwd(fn, *tensors, grad_out)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fwd_bwd(fn, *tensors, grad_out)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def length_table(args) -> None:
    print(
        f"\nfp32, [1, {args.rows}, L, {args.heads}, {args.dim}], both biases, forward + backward "
        f"({torch.get_num_threads()} threads)\n"
    )
    print(
        "| L | naive peak MiB | zerospeed peak MiB | peak ratio | naive saved MiB | zerospeed saved MiB "
        "| naive time s | zerospeed time s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L in args.lengths:
        tensors = make_inputs((1, args.rows, L, args.heads, args.dim), torch.float32, deepspeed_mask=False)
        grad_out = torch.rand(tensors[0].shape)
        row = {}
        for name, fn in (("naive", naive), ("ours", ours)):
            row[name] = (
                peak_mib(fn, tensors, grad_out),
                saved_mib(fn, tensors),
                time_s(fn, tensors, grad_out, args.repeats),
            )
        (np_, ns, nt), (op, os_, ot) = row["naive"], row["ours"]
        print(
            f"| {L} | {np_:,.1f} | {op:,.1f} | {np_ / op:.1f}x | {ns:,.1f} | {os_:,.1f} | {nt:.3f} | {ot:.3f} |",
            flush=True,
        )


def chunked_reference(q, k, v, bias1, bias2, grad_out, rows: int = 16):
    """float64 naive output and grads (q, k, v, bias1, bias2), `rows` MSA rows at a time (dBias2 summed)."""
    up = lambda t: t.detach().double()  # noqa: E731
    out, dq, dk, dv, db1 = (torch.empty(t.shape, dtype=torch.float64) for t in (q, q, k, v, bias1))
    db2 = torch.zeros(bias2.shape, dtype=torch.float64)
    b2 = up(bias2).requires_grad_()
    for n0 in range(0, q.shape[1], rows):
        sl = slice(n0, n0 + rows)
        qs, ks, vs, b1s = (up(t[:, sl]).requires_grad_() for t in (q, k, v, bias1))
        o = naive(qs, ks, vs, [b1s, b2])
        g = torch.autograd.grad(o, (qs, ks, vs, b1s, b2), up(grad_out[:, sl]))
        out[:, sl], dq[:, sl], dk[:, sl], dv[:, sl], db1[:, sl] = o.detach(), *g[:4]
        db2 += g[4]
    return out, (dq, dk, dv, db1, db2)


def deepspeed_shapes_table(args) -> None:
    print(
        "\nDeepSpeed's test shapes: max-abs error against float64 (DeepSpeed's tolerance: 5e-2 bf16 / 1e-2 "
        "fp16 on O, dQ, dK, dV; twice that on the bias gradients), zerospeed forward + backward\n"
    )
    print("| shape (B, N, L, H, D) | dtype | O | dQ | dK | dV | dBias1 | dBias2 | time s | peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in ((1, 256, 256, 4, 32), (1, 512, 256, 8, 8)):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, bias1, bias2 = make_inputs(shape, dtype)
            bias1.requires_grad_()
            grad_out = torch.rand(shape).to(dtype)
            t0 = time.perf_counter()
            out = ours(q, k, v, [bias1, bias2])
            grads = torch.autograd.grad(out, (q, k, v, bias1, bias2), grad_out)
            elapsed = time.perf_counter() - t0
            ref_out, ref_grads = chunked_reference(q, k, v, bias1, bias2, grad_out)
            errs = [(out.double() - ref_out).abs().max().item()]
            errs += [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
            peak = peak_mib(lambda q, k, v, b: ours(q, k, v, b), (q, k, v, bias1, bias2), grad_out)
            cells = " | ".join(f"{e:.2e}" for e in errs)
            print(f"| {shape} | {str(dtype)[6:]} | {cells} | {elapsed:.2f} | {peak:,.0f} |", flush=True)
    print(
        "\n(dBias1 in bf16: |dBias1| reaches ~45 at (1, 256, 256, 4, 32), where one bf16 ulp is 0.25: the error "
        "is the rounding of the exact value to bf16. DeepSpeed's test gives the mask no gradient.)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[256, 512, 1024])
    parser.add_argument("--rows", type=int, default=16, help="N (MSA rows)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-deepspeed-shapes", action="store_true", help="skip table 2")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length_table(args)
    if not args.no_deepspeed_shapes:
        deepspeed_shapes_table(args)


if __name__ == "__main__":
    main()
