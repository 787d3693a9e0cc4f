"""Communication compression on this machine: step time and bytes on the wire per rank, with and without
each compression, side by side with PyTorch DDP, in one invocation.

    python benchmarks/comm_compression.py [--world 2 --layers 4 --width 256 --steps 12 --warmup 3]

Model: the demo GPT (`zoo.models.GPT`, fp32), the same micro-batch per rank and step for
every variant. The 1-bit optimizers are measured in their compressed stage (freeze / var_freeze step =
`--warmup`: the measured steps come after it); 0/1 Adam twice, synchronising every step and with local
steps (every 4th step synchronises); 1-bit Adam also at ZeRO-1 and ZeRO-2, where the compressed stage
still all-gathers the updated parameters every step. ZeRO++ variants (stage 3, and each of qwZ / qgZ / hpZ) run with
`--zeropp` when the stage-3 switches are available. `--lora`: the same GPT with LoRA adapters (peft, rank 8,
on every linear layer) over a frozen base at stage 3, whose frozen weights are partitioned, with and without
`zero_quantized_nontrainable_weights` (int8-stored frozen shards); "param MiB / rank" is what the engine
holds of the parameters (`memory_breakdown()["parameters"]`).

- step s: the median over the measured steps of the slowest rank's forward + backward + step time.
- wire MiB / rank / step: what the zerospeed gateway counted leaving one rank (`comm.STATS` wire bytes;
  ring all-reduce = 2(N-1)/N of the payload); DDP's bucketed all-reduce is the same ring over the
  parameter bytes (not counted by the gateway, computed).
- of it outside the hpZ sub-group: the same less the collectives that stay inside an hpZ sub-group of
  `zero_hpz_partition_size` ranks (one node when the launcher's LOCAL_WORLD_SIZE equals it) — what a
  slow inter-node link carries.
- bytes ratio / time ratio: against the uncompressed counterpart (Adam, LAMB, ZeRO-3) of the same row.

On a 2-core machine with ranks on one host, bytes are cheap and compression's extra compute shows; on a
slow link the byte ratio is what matters — both are reported.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

VARIANTS = {  # name: (optimizer type, params, zero stage, uncompressed counterpart)
    "Adam (ZeRO-0)": ("Adam", {}, 0, None),
    "OneBitAdam": ("OneBitAdam", {"freeze_step": None}, 0, "Adam (ZeRO-0)"),
    "ZeroOneAdam (sync every step)": (
        "ZeroOneAdam",
        {"var_freeze_step": None, "local_step_clipper": 1},
        0,
        "Adam (ZeRO-0)",
    ),
    "ZeroOneAdam (local steps, sync 1 in 4)": (
        "ZeroOneAdam",
        {"var_freeze_step": None, "local_step_clipper": 4, "local_step_scaler": 1},
        0,
        "Adam (ZeRO-0)",
    ),
    "Adam (ZeRO-1)": ("Adam", {}, 1, None),
    "OneBitAdam (ZeRO-1)": ("OneBitAdam", {"freeze_step": None}, 1, "Adam (ZeRO-1)"),
    "Adam (ZeRO-2)": ("Adam", {}, 2, None),
    "OneBitAdam (ZeRO-2)": ("OneBitAdam", {"freeze_step": None}, 2, "Adam (ZeRO-2)"),
    "Lamb (ZeRO-0)": ("Lamb", {}, 0, None),
    "OneBitLamb": ("OneBitLamb", {"freeze_step": None}, 0, "Lamb (ZeRO-0)"),
}
ZEROPP = {  # name: (zero_optimization extras, counterpart)
    "ZeRO-3": ({}, None),
    "ZeRO-3 + qwZ": ({"zero_quantized_weights": True}, "ZeRO-3"),
    "ZeRO-3 + qgZ": ({"zero_quantized_gradients": True}, "ZeRO-3"),
    "ZeRO-3 + hpZ (2)": ({"zero_hpz_partition_size": 2}, "ZeRO-3"),
    "ZeRO-3 + qwZ + qgZ + hpZ (2)": (
        {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
        "ZeRO-3",
    ),
}


LORA = {  # name: (zero_optimization extras, counterpart)
    "ZeRO-3 LoRA (frozen base partitioned)": ({}, None),
    "ZeRO-3 LoRA + zero_quantized_nontrainable_weights": (
        {"zero_quantized_nontrainable_weights": True},
        "ZeRO-3 LoRA (frozen base partitioned)",
    ),
}

INTRA_KINDS = ("all_gather_hpz", "reduce_scatter_int4_intra")  # collectives inside an hpZ sub-group ("node")


def _model(args):
    from zoo.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=256,
            block_size=args.seq,
            n_layer=args.layers,
            n_head=args.width // 64,
            n_embd=args.width,
            bias=False,
        )
    )


def _batches(args, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 256, (args.micro, args.seq + 1), generator=g) for _ in range(args.warmup + args.steps)]


def _measure(step, args, rank) -> dict:
    from zerospeed import comm

    times = []
    for i, seq in enumerate(_batches(args, rank)):
        if i == args.warmup:
            comm.STATS.reset()
        comm.barrier()
        start = time.perf_counter()
        step(seq[:, :-1], seq[:, 1:])
        t = torch.tensor([time.perf_counter() - start])
        comm.all_reduce(t, op="max")
        if i >= args.warmup:
            times.append(t.item())
    world = comm.get_world_size()
    wire = comm.STATS.total_wire_bytes() - 2 * (world - 1) / world * 4 * args.steps  # (minus the timing all-reduce)
    intra = sum(k["wire_bytes"] for kind, k in comm.STATS.snapshot().items() if kind in INTRA_KINDS)
    return {
        "step_s": statistics.median(times),
        "wire_mib": wire / args.steps / 2**20,
        "inter_mib": (wire - intra) / args.steps / 2**20,
    }


def _lora(model):
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    return inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, target_modules=["qkv", "proj", "fc"]), model)


def _zerospeed(args, opt_type: str, params: dict, stage: int, zero_extra: dict, lora: bool = False) -> dict:
    import zerospeed
    from zerospeed import comm

    params = {k: (args.warmup - 1 if v is None else v) for k, v in params.items()}
    params.setdefault("lr", 1e-3 if "Lamb" not in opt_type else 1e-2)
    model = _lora(_model(args)) if lora else _model(args)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": opt_type, "params": params},
        "zero_optimization": {"stage": stage, **zero_extra},
    }
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    out = _measure(step, args, comm.get_rank())
    out["param_mib"] = engine.zero.memory_breakdown(None)["parameters"] / 2**20
    return out


def _ddp(args) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from zerospeed import comm

    model = _model(args)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        opt.step()

    out = _measure(step, args, comm.get_rank())
    world = comm.get_world_size()
    out["wire_mib"] = out["inter_mib"] = (
        2 * (world - 1) / world * sum(p.numel() * 4 for p in model.parameters()) / 2**20
    )
    return out


def _all(args) -> dict:
    rows = {"PyTorch DDP + Adam": _ddp(args)}
    for name, (opt_type, params, stage, _) in ({} if args.only_extras else VARIANTS).items():
        rows[name] = _zerospeed(args, opt_type, dict(params), stage, {})
    if args.zeropp:
        for name, (extra, _) in ZEROPP.items():
            # every unit released after its use, so backward re-gathers it (what large models do; hpZ's case)
            rows[name] = _zerospeed(
                args, "Adam", {}, 3, {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **extra}
            )
    if args.lora:
        for name, (extra, _) in LORA.items():
            rows[name] = _zerospeed(
                args,
                "Adam",
                {},
                3,
                {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **extra},
                lora=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--zeropp", action="store_true", help="also ZeRO-3 with the ZeRO++ switches")
    p.add_argument("--lora", action="store_true", help="also LoRA at ZeRO-3, with and without int8 frozen shards")
    p.add_argument("--only-extras", action="store_true", help="skip the optimizer rows (DDP still runs)")
    args = p.parse_args()
    from harness import run_distributed

    rows = run_distributed(_all, args.world, args, timeout=3600)[0]
    counterpart = {
        **{k: v[3] for k, v in VARIANTS.items()},
        **{k: v[1] for k, v in ZEROPP.items()},
        **{k: v[1] for k, v in LORA.items()},
        "PyTorch DDP + Adam": None,
    }
    n = sum(p.numel() for p in _model(args).parameters())
    print(
        f"# comm compression — {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, gloo, {args.world} ranks; "
        f"GPT {args.layers}x{args.width} ({n / 1e6:.2f} M params), "
        f"micro {args.micro} x {args.seq}, {args.steps} measured steps\n"
    )
    print(
        "| variant | step s | wire MiB / rank / step | of it outside the hpZ sub-group | bytes ratio | "
        "outside-sub-group ratio | time ratio | param MiB / rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        base = rows.get(counterpart.get(name) or "")
        br = f"{r['wire_mib'] / base['wire_mib']:.3f}" if base else "—"
        ir = f"{r['inter_mib'] / base['inter_mib']:.3f}" if base else "—"
        tr = f"{r['step_s'] / base['step_s']:.2f}" if base else "—"
        pm = f"{r['param_mib']:.2f}" if "param_mib" in r else "—"
        print(
            f"| {name} | {r['step_s']:.3f} | {r['wire_mib']:.3f} | {r['inter_mib']:.3f} | {br} | {ir} | {tr} | {pm} |"
        )


if __name__ == "__main__":
    main()
