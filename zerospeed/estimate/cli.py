"""`zerospeed-estimate`: memory per device and per host for every ZeRO option, and a recommendation.

zerospeed-estimate --params 7.5B --devices-per-node 8 --nodes 8
zerospeed-estimate --model-config config.json --micro-batch 4 --seq-len 2048 --device-memory 80
zerospeed-estimate --model-config config.json --devices-per-node 8 --tp 4 --pp 2 --seq-len 2048
zerospeed-estimate --model-config config.json --devices-per-node 8 --device-memory 80 --layouts
zerospeed-estimate --measure --ranks 2
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from zerospeed.estimate.census import ModelCensus, census_of_file, parse_count
from zerospeed.estimate.formulas import DTYPE_BYTES
from zerospeed.estimate.measure import format_measurements, measure
from zerospeed.estimate.plan import Setup, format_layouts, format_plan, layout_rows, plan_rows, recommend
from zerospeed.zero.memory import OPTIMIZER_STATE_BYTES

GB = 1e9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerospeed-estimate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--params", help="total parameters, e.g. 7.5B, 350M")
    src.add_argument("--model-config", help="a transformers config.json or a zerospeed GPT config (JSON)")
    p.add_argument("--largest-layer", help="largest layer's parameters (stage 3 / param offload), e.g. 32M")
    p.add_argument("--devices-per-node", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--precision", choices=sorted(DTYPE_BYTES), default="fp16")
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), help="gradient dtype (default: --precision)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adam")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, help="sequence length for the activation estimate")
    p.add_argument("--layers", type=int, help="transformer layers (with --params, for activations)")
    p.add_argument("--hidden", type=int, help="hidden size (with --params, for activations)")
    p.add_argument("--heads", type=int, help="attention heads (with --params, for activations)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (needs --model-config)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (needs --model-config)")
    p.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence parallelism with --tp: activations all / tp"
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        help="micro-batches per step (gradient accumulation); with --pp, 1F1B holds min(pp, this)",
    )
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="collectives' backend for the peak's staging terms (gloo on CPU-only machines)",
    )
    p.add_argument(
        "--attention",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="sdpa (fused attention, PyTorch's and transformers' default: no s x s scores kept for "
        "backward) or eager (the scores, softmax and dropout mask are kept: + 5*a*s/h per token "
        "and hidden unit)",
    )
    p.add_argument(
        "--layouts",
        action="store_true",
        help="with --device-memory: every valid dp x tp x pp and its fastest option that fits",
    )
    p.add_argument("--device-memory", type=float, help="GB (1e9 bytes) per device, for the recommendation")
    p.add_argument("--host-memory", type=float, help="GB (1e9 bytes) per node, for the recommendation")
    p.add_argument(
        "--measure",
        action="store_true",
        help="run the engine (bf16, AdamW, 1M-parameter MLP) on --ranks processes and print predicted vs "
        "measured model-state bytes per rank, stages 0-3",
    )
    p.add_argument("--ranks", type=int, default=2, help="processes for --measure")
    return p


def _census(args) -> ModelCensus:
    if args.model_config:
        c = census_of_file(args.model_config)
    elif args.params:
        c = ModelCensus(parse_count(args.params), 0, args.layers, args.hidden, args.heads)
    else:
        raise ValueError("give --params or --model-config (or --measure)")
    if args.largest_layer:
        c = replace(c, largest_layer_params=parse_count(args.largest_layer))
    return c


def run(args) -> str:
    """The report text for parsed arguments."""
    if args.measure:
        return format_measurements(measure(world=args.ranks, stages=(0, 1, 2, 3)))
    census = _census(args)
    setup = Setup(
        args.devices_per_node,
        args.nodes,
        args.precision,
        args.optimizer,
        args.grad_dtype,
        args.micro_batch,
        args.seq_len,
        tp=args.tp,
        pp=args.pp,
        sequence_parallel=args.sequence_parallel,
        micro_batches=args.micro_batches,
        backend=args.backend,
        attention=args.attention,
    )
    if args.layouts:
        if not args.device_memory:
            raise ValueError("--layouts needs --device-memory (GB per device) to pick an option per layout")
        return format_layouts(
            layout_rows(census, setup, args.device_memory * GB, args.host_memory * GB if args.host_memory else None),
            GB,
            "GB",
        )
    rows = plan_rows(census, setup)
    out = [
        f"model: {census.total_params:,} parameters (largest layer {census.largest_layer_params:,}); "
        f"{setup.nodes} node(s) x {setup.devices_per_node} device(s); {setup.precision}, {setup.optimizer}"
    ]
    if setup.tp * setup.pp > 1:
        out.append(
            f"layout: dp {rows[0].dp} x tp {setup.tp} x pp {setup.pp}"
            + (" (sequence parallel)" if setup.sequence_parallel else "")
            + "; bytes per rank: tp rank 0 of the pipeline stage with the largest total"
        )
    out.append(format_plan(rows, GB, "GB"))
    if any(r.peak is not None for r in rows):
        out.append(
            "peak: the step's predicted peak per device (model states + activations, logits, the live "
            "parameter window, reduce buckets, optimizer temporaries; zerospeed.estimate.peak), with the "
            "largest single contribution at that moment and its phase; the recommendation uses it"
        )
    if not any(r.device["activations"] for r in rows):
        out.append("activations: not estimated (give --model-config, or --layers/--hidden/--heads and --seq-len)")
    if args.device_memory:
        best = recommend(rows, args.device_memory * GB, args.host_memory * GB if args.host_memory else None)
        out.append(
            f"recommendation for {args.device_memory:g} GB per device: "
            + (best.label() if best else "nothing fits; add devices or shrink the micro-batch")
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except ValueError as exc:
        print(f"zerospeed-estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
