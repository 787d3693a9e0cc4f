"""The largest GPT one GPU trains with ZeRO-3 + offload, its TFLOPs, and the same without offload.

    python benchmarks/gpu/offload_largest.py --nvme-path /tmp/zs_nvme   # one command, < 10 minutes
    python benchmarks/gpu/offload_largest.py --smoke                     # tiny sizes on the CPU: checks the script

For each mode — no offload, optimizer + parameters offloaded to CPU, optimizer + parameters offloaded
to NVMe — it takes a ladder of GPT sizes (bf16, ZeRO stage 3, 1 process) from the largest down and
trains each for a few steps; the first size whose steps complete is that mode's answer. A size is
skipped, not tried, when the device memory, host memory or disk it needs (the ZeRO formulas, plus
34 x seq x batch x width x layers bytes of bf16 activations on the device with no offload) exceeds
the device's memory or 90% of the free host memory or disk, or it is above the mode's `--cap`; a size that runs out
of device memory hands
over to the next smaller one. TFLOPs are model FLOPs: 6 x parameters x tokens plus attention
12 x layers x seq^2 x width per token (forward + backward, no recompute), over the median step time;
each row also shows the engine's forward / backward / step times (`wall_clock_breakdown`, mean of
the timed steps), which say where an offloaded step spends its time. Writes a markdown table to
stdout (and --out).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from zerospeed.accelerator import get_accelerator

# (layers, width, heads): ~0.35B, 0.76B, 1.3B, 2.7B, 6.7B, 13B parameters (GPT-3 table shapes)
LADDER = [(24, 1024, 16), (24, 1536, 16), (24, 2048, 16), (32, 2560, 32), (32, 4096, 32), (40, 5120, 40)]
SMOKE_LADDER = [(2, 64, 2), (2, 128, 4)]
VOCAB, SEQ = 50304, 1024


def n_params(layers: int, width: int, vocab: int = VOCAB, seq: int = SEQ) -> int:
    return 12 * layers * width * width + vocab * width + seq * width


def needs(mode: str, n: int) -> tuple[int, int]:
    """(host bytes, disk bytes) the mode needs for n parameters (bf16 params, fp32 grads/masters, Adam)."""
    if mode == "none":
        return 0, 0
    if mode == "cpu":
        return 18 * n, 0  # bf16 shard 2 + fp32 grad 4 + master 4 + Adam 8
    return 4 * n, 14 * n  # host: fp32 grads; disk: bf16 shard 2 + master 4 + Adam 8


def device_needs(mode: str, shape, micro: int, seq: int = SEQ) -> int:
    """Device bytes with no offload: the 18 bytes of model states per parameter and the block
    activations kept for backward (~34 x seq x batch x width bytes per layer in bf16, no attention
    matrix with sdpa); offloaded modes keep a few units and the activations only (not counted)."""
    layers, width, _ = shape
    return 18 * n_params(layers, width) + 34 * seq * micro * width * layers if mode == "none" else 0


def config(mode: str, micro: int, nvme: str) -> dict:
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": 50_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "sub_group_size": 200_000_000,
    }
    if mode == "cpu":
        zero |= {
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        }
    elif mode == "nvme":
        zero |= {
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "pipeline_read": True,
                "pipeline_write": True,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "buffer_count": 6,
                "buffer_size": 300_000_000,
            },
        }
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": True,
    }


def _timed_steps(step, steps: int, after_warmup=lambda: None) -> tuple[list[float], torch.Tensor]:
    """Wall times of `steps` + 1 calls of `step` (the first a warm-up), the device synchronised around
    each; `after_warmup` runs after the first; returns the times and the last loss."""
    acc, times = get_accelerator(), []
    for i in range(steps + 1):
        acc.synchronize()
        t0 = time.perf_counter()
        loss = step()
        acc.synchronize()
        times.append(time.perf_counter() - t0)
        if i == 0:
            after_warmup()
    return times, loss


def try_size(mode: str, shape, args) -> dict:
    import zerospeed
    from zoo.models import GPT, GPTConfig

    layers, width, heads = shape
    vocab, seq = (256, 64) if args.smoke else (VOCAB, SEQ)
    cfg = config(mode, args.micro_batch, args.nvme_path)
    if args.smoke:
        cfg["zero_optimization"].get("offload_param", {}).update(buffer_size=1_000_000)
    acc = get_accelerator()
    build_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # fast random init
    with build_on, zerospeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, bias=False))
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    x = torch.randint(0, vocab, (args.micro_batch, seq), device=engine.device)

    def step():
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return loss

    try:
        # (the phase timers, wall_clock_breakdown, count the timed steps only)
        times, loss = _timed_steps(step, args.steps, after_warmup=engine.observer.timers.reset)
        placement = engine.placement()
        phases = engine.observer.timers.breakdown(args.steps)
    finally:
        engine.destroy()
    step = statistics.median(times[1:])
    n = n_params(layers, width, vocab, seq)
    tokens = args.micro_batch * seq
    flops = (6 * n + 12 * layers * seq * width) * tokens
    return {
        "params": n,
        "step_s": step,
        "tflops": flops / step / 1e12,
        "placement": placement,
        "gpu_peak_gib": acc.max_memory_allocated() / 2**30,
        "loss": loss.item(),
        "phases_ms": phases,
    }


def try_fsdp2(mode: str, shape, args) -> dict:
    """PyTorch's FSDP2 at the same size, on one GPU: `fully_shard` on every block and the root, bf16
    compute with fp32 sharded parameters and gradient reduction (MixedPrecisionPolicy), AdamW (fused),
    gradient clipping; `mode` "cpu": CPUOffloadPolicy (pinned), the parameters, gradients and the
    optimizer step on the host. The same model, batch and step count as `try_size`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from zoo.models import GPT, GPTConfig

    layers, width, heads = shape
    vocab, seq = (256, 64) if args.smoke else (VOCAB, SEQ)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    acc = get_accelerator()
    mesh = init_device_mesh(dev.type, (1,))
    policy = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=dev.type == "cuda") if mode == "cpu" else OffloadPolicy(),
    )
    with dev:
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, bias=False))
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (args.micro_batch, seq), device=dev)

    def step():
        loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, loss = _timed_steps(step, args.steps)  # (the model is freed on return; the caller empties the cache)
    return {
        "step_s": statistics.median(times[1:]),
        "gpu_peak_gib": acc.max_memory_allocated() / 2**30,
        "loss": loss.item(),
    }


class _ProgressRows(list):
    """The table's rows; each is also printed to stderr as it comes, so a run cut short (a time cap)
    still shows what it measured."""

    def append(self, row) -> None:
        mode, shape, n, what = row
        print(f"[offload_largest] {mode} {shape or ''} {n / 1e9:.2f}B: {what}", file=sys.stderr, flush=True)
        super().append(row)


def _fsdp2_row(mode: str, shape, args, ours: dict) -> str:
    get_accelerator().reset_peak_memory_stats()
    try:
        f = try_fsdp2(mode, shape, args)
    except torch.OutOfMemoryError:
        return "FSDP2: CUDA out of memory at this size"
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return (
        f"FSDP2: {f['step_s'] * 1e3:.0f} ms/step, device peak {f['gpu_peak_gib']:.1f} GiB; zerospeed step time "
        f"/ FSDP2 = {ours['step_s'] / f['step_s']:.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", default="/tmp/zerospeed_nvme")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="none,cpu,nvme")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new sizes after this")
    p.add_argument(
        "--cap",
        nargs="*",
        default=[],
        metavar="MODE=BILLIONS",
        help="largest size to try in a mode, e.g. nvme=1.4 (the NVMe mode moves every state each step)",
    )
    p.add_argument(
        "--fsdp2",
        action="store_true",
        help="also train PyTorch FSDP2 (no offload / CPUOffloadPolicy) at each mode's answer, for the ratio",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="two tiny sizes on whatever device there is (a check)")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("benchmarks/gpu/offload_largest.py needs a CUDA device (or --smoke)")
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29533"),
        }
    )
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    caps = dict((m, float(b) * 1e9) for m, b in (c.split("=") for c in args.cap))
    gpu_total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else float("inf")
    start = time.monotonic()
    rows = _ProgressRows()
    for mode in args.modes.split(","):
        best = None
        for shape in reversed(SMOKE_LADDER if args.smoke else LADDER):
            n = n_params(shape[0], shape[1])
            host, disk = needs(mode, n)
            dev = 0 if args.smoke else device_needs(mode, shape, args.micro_batch)
            free_host = psutil.virtual_memory().available
            free_disk = shutil.disk_usage(args.nvme_path).free
            if n > caps.get(mode, float("inf")):
                rows.append((mode, shape, n, f"skipped: above --cap {mode}={caps[mode] / 1e9:g}B"))
                continue
            if host > 0.9 * free_host or disk > 0.9 * free_disk or dev > gpu_total:  # (an OOM hands down)
                rows.append(
                    (
                        mode,
                        shape,
                        n,
                        f"skipped: needs {dev / 2**30:.0f} GiB device / {host / 2**30:.0f} GiB "
                        f"host / {disk / 2**30:.0f} GiB disk, {gpu_total / 2**30:.0f} / {free_host / 2**30:.0f} / "
                        f"{free_disk / 2**30:.0f} free",
                    )
                )
                continue
            if time.monotonic() - start > args.budget_s:
                rows.append((mode, shape, n, "not tried: time budget spent"))
                break
            get_accelerator().reset_peak_memory_stats()
            try:
                r = try_size(mode, shape, args)
            except torch.OutOfMemoryError:
                rows.append((mode, shape, n, "CUDA out of memory"))
                continue
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            best = r
            phases = " / ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items())
            rows.append(
                (
                    mode,
                    shape,
                    n,
                    f"ok: {r['step_s'] * 1e3:.0f} ms/step ({phases} ms), {r['tflops']:.2f} "
                    f"TFLOPs, device peak {r['gpu_peak_gib']:.1f} GiB, state: {r['placement']}",
                )
            )
            if args.fsdp2 and mode in ("none", "cpu"):
                rows.append((f"{mode}: FSDP2", shape, n, _fsdp2_row(mode, shape, args, r)))
            break
        rows.append((mode, None, best["params"] if best else 0, "largest that trained"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (--smoke on the CPU)"
    lines = [
        f"GPU: {device}, host RAM {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"micro batch {args.micro_batch} x seq {64 if args.smoke else SEQ}, bf16, ZeRO-3, 1 GPU",
        "",
        "| mode | layers x width | parameters | result |",
        "|---|---|---:|---|",
    ]
    for mode, shape, n, what in rows:
        lines.append(f"| {mode} | {'' if shape is None else f'{shape[0]} x {shape[1]}'} | {n / 1e9:.2f}B | {what} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
