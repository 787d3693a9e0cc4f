"""The largest GPT one GPU trains in each offload mode, its model TFLOPs, and where each step's time goes.

    python benchmarks/gpu/offload_largest.py --nvme-path /tmp/zs_nvme --budget-s 540   # one command, < 10 min
    python benchmarks/gpu/offload_largest.py --smoke      # tiny sizes on the CPU: checks every mode (< 2 min)
    python benchmarks/gpu/offload_largest.py --modes cpu_opt_z2,delayed_z2 --budget-s 300   # a subset, deeper

Modes (GPT-3 table shapes, bf16, AdamW, gradient clipping 1.0, one process):

- ``none``: ZeRO-3, nothing offloaded (the device-only baseline).
- ``cpu_opt_z2``: ZeRO-2, ``offload_optimizer: cpu`` (ZeRO-Offload): fp32 masters, Adam moments and the
  fp32 gradient shard on the host, the optimizer step there (overlapped: Note [overlapped step]).
- ``cpu_opt_z3``: ZeRO-3, ``offload_optimizer: cpu``, the parameters stay on the device.
- ``cpu_opt_param_z3`` (also ``cpu``): ZeRO-3, optimizer and parameters offloaded to the host (ZeRO-Infinity on CPU).
- ``zenflow_z2``: ZeRO-2 + ``offload_optimizer: cpu`` + ``zenflow`` with DeepSpeed's tutorial settings
  (topk_ratio 0.05, select "auto"/"auto", update_interval 4, full_warm_up_rounds 0, overlap_step true).
- ``delayed_z2``: ``cpu_opt_z2`` with ``delayed_param_update`` (zerospeed's key; ZeRO-Offload's one-step
  delayed parameter update: changes the numbers, Note [delayed parameter update]).
- ``nvme``: ZeRO-3, optimizer and parameters offloaded to NVMe (``--nvme-path``).
- ``fsdp2`` / ``fsdp2_cpu``: PyTorch FSDP2 (`fully_shard` per block and the root, bf16 compute, fp32
  sharded parameters, fused AdamW) without and with ``CPUOffloadPolicy``, at the sizes ``none`` and
  ``cpu_opt_param_z3`` reached (the same placement of states), with the same accumulation.

For each mode the script takes the GPT ladder from the largest size down. A size is skipped when the
device memory, host memory or disk its mode needs (formulas below) exceeds the device's memory, 75%
of the free host memory (pinned) or 90% of the free disk, or when its estimated time (build + warm-up,
timed and profiled steps) exceeds the mode's share of what is left of ``--budget-s``; an
out-of-memory hands down to the next size. Each mode's first size that trains is its answer
("largest that fits", or "time-capped" when a larger one fit in memory but not in time).

Gradient accumulation is chosen as a user would: the smallest power of two (at most ``--max-gas``)
for which the estimated host work of one optimizer step (the CPU optimizer's memory traffic, NVMe
swaps) is at most a quarter of the step's forward + backward time, so the host step is amortised;
1 for device-only modes; FSDP2 uses its zerospeed partner's. ``--gas N`` fixes it. The output says
which it took and why.

TFLOPs are model FLOPs: (6 x parameters + 12 x layers x seq x width) per token (forward + backward, no
recompute) over the median step time. Each mode's last step runs under torch.profiler (CUDA
activity) with optimizer-step hooks timing every `optimizer.step()` on any thread, and is summarised
as a timeline row: device compute (union of kernels), H2D and D2H copies, host optimizer (union of
CPU optimizer steps), the host optimizer's overlap with device compute, and device idle (step wall
time minus the union of all device activity), so the next gap is visible.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from zerospeed.accelerator import get_accelerator

# (layers, width, heads): ~0.35B, 0.76B, 1.3B, 2.7B, 6.7B, 13B parameters (GPT-3 table shapes)
LADDER = [(24, 1024, 16), (24, 1536, 16), (24, 2048, 16), (32, 2560, 32), (32, 4096, 32), (40, 5120, 40)]
SMOKE_LADDER = [(2, 64, 2), (2, 128, 4)]
VOCAB, SEQ = 50304, 1024
SMOKE_VOCAB, SMOKE_SEQ = 256, 64
MODES = ("none", "cpu_opt_z2", "cpu_opt_z3", "cpu_opt_param_z3", "zenflow_z2", "delayed_z2", "nvme")
ALIASES = {"cpu": "cpu_opt_param_z3"}
FSDP2_PARTNER = {"fsdp2": "none", "fsdp2_cpu": "cpu_opt_param_z3"}
ZENFLOW_TUTORIAL = {
    "topk_ratio": 0.05,
    "select_strategy": "auto",
    "select_interval": "auto",
    "update_interval": 4,
    "full_warm_up_rounds": 0,
    "overlap_step": True,
}


def n_params(layers: int, width: int, vocab: int = VOCAB, seq: int = SEQ) -> int:
    return 12 * layers * width * width + vocab * width + seq * width


# -- what a mode needs ------------------------------------------------------------------------------
def needs(mode: str, n: int) -> tuple[int, int]:
    """(host bytes, disk bytes) of the model states for n parameters (bf16 parameters, fp32 gradients,
    masters and Adam moments)."""
    host = {
        "none": 0,
        "fsdp2": 0,
        "cpu_opt_z2": 16 * n,  # master 4 + Adam 8 + fp32 gradient shard 4
        "cpu_opt_z3": 16 * n,
        "cpu_opt_param_z3": 18 * n,  # + the bf16 parameter shard 2
        "zenflow_z2": 24 * n,  # + two gradient accumulators (overlap_step) 8
        "delayed_z2": 20 * n,  # + the delayed step's own copy of the gradients 4
        "fsdp2_cpu": 16 * n,  # fp32 parameters 4 + fp32 gradients 4 + Adam 8
        "nvme": 4 * n,  # fp32 gradient shard; the rest on disk
    }[mode]
    return host, 14 * n if mode == "nvme" else 0


def device_needs(mode: str, shape, micro: int, seq: int = SEQ, vocab: int = VOCAB) -> int:
    """Device bytes: model states kept on the device plus the block activations kept for backward
    (~34 x seq x batch x width bytes per layer in bf16, sdpa attention) and the logits (bf16 + fp32)."""
    layers, width, _ = shape
    n = n_params(layers, width, vocab, seq)
    states = {"none": 18 * n, "fsdp2": 18 * n, "cpu_opt_z2": 2 * n, "cpu_opt_z3": 2 * n, "delayed_z2": 2 * n}
    states["zenflow_z2"] = 2 * n + 16 * n // 20  # + the selected 5% columns' fp32 weights, moments
    act = 34 * seq * micro * width * layers + 6 * micro * seq * vocab
    return states.get(mode, 0) + act


class Rates:
    """What the time estimates assume, refined as measurements come in: model FLOP/s of the device,
    the host's fused CPU AdamW in parameters/s, PCIe and disk bytes/s."""

    def __init__(self, smoke: bool):
        self.flops = 2e11 if smoke else 250e12
        self.adam = measure_cpu_adam() if not smoke else 2e8
        self.pcie = 1e10
        self.disk = 1e9

    def host_step_s(self, mode: str, n: int) -> float:
        """One optimizer step's host work (the CPU AdamW; NVMe reads + writes of the states)."""
        if mode in ("none", "fsdp2"):
            return 0.0
        if mode == "nvme":
            return n / self.adam + 2 * 14 * n / self.disk
        if mode == "zenflow_z2":
            return n / self.adam / ZENFLOW_TUTORIAL["update_interval"]
        return n / self.adam

    def micro_s(self, mode: str, n: int, flops_per_micro: float) -> float:
        """One micro-step: forward + backward, and what crosses PCIe each micro-step (gradients to the
        host at ZeRO-2/3 with offload; parameters in twice with parameter offload)."""
        per_micro = {"cpu_opt_z2": 2, "cpu_opt_z3": 2, "zenflow_z2": 2, "delayed_z2": 2}
        per_micro |= {"cpu_opt_param_z3": 6, "nvme": 6, "fsdp2_cpu": 8}
        return flops_per_micro / self.flops + per_micro.get(mode, 0) * n / self.pcie


def measure_cpu_adam() -> float:
    """Parameters per second of torch's fused CPU AdamW over 32M fp32 parameters (best of 3)."""
    p = torch.nn.Parameter(torch.zeros(32 * 2**20))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], fused=True)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return p.numel() / best


def choose_gas(mode: str, n: int, flops_per_micro: float, rates: Rates, args) -> tuple[int, str]:
    """Note in the module docstring: the smallest power of two whose fwd+bwd is >= 4x the host step."""
    if args.gas:
        return args.gas, "fixed by --gas"
    host, micro = rates.host_step_s(mode, n), rates.micro_s(mode, n, flops_per_micro)
    if host == 0.0:
        return 1, "device-only: nothing to amortise"
    gas = min(args.max_gas, 2 ** max(0, math.ceil(math.log2(max(1.0, 4 * host / micro)))))
    return gas, f"host step ~{host:.2f} s vs ~{micro:.2f} s per micro-step: smallest 2^k with fwd+bwd >= 4x host"


# -- configs ----------------------------------------------------------------------------------------
def config(mode: str, micro: int, gas: int, nvme: str) -> dict:
    stage = 2 if mode.endswith("_z2") else 3
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 50_000_000, "sub_group_size": 200_000_000}
    if stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50_000_000}
    else:
        zero |= {"allgather_bucket_size": 200_000_000}
    if mode != "none" and mode != "nvme":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if mode == "cpu_opt_param_z3":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if mode == "zenflow_z2":
        zero["zenflow"] = dict(ZENFLOW_TUTORIAL)
    if mode == "delayed_z2":
        zero["offload_optimizer"]["delayed_param_update"] = True
    if mode == "nvme":
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
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": True,
    }


# -- the per-step timeline ------------------------------------------------------------------------
class OptimizerSpans:
    """Wall-clock spans (time.time_ns, the profiler's clock) of every optimizer.step() on any thread,
    with the device of the parameters it stepped; torch.profiler misses ops of threads it did not start."""

    def __init__(self):
        self.spans: list[tuple[int, int, str]] = []
        self._open: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._handles = []

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _pre(self, opt, *_):
        with self._lock:
            self._open[(id(opt), threading.get_ident())] = time.time_ns()

    def _post(self, opt, *_):
        end = time.time_ns()
        dev = next((p.device.type for g in opt.param_groups for p in g["params"]), "cpu")
        with self._lock:
            start = self._open.pop((id(opt), threading.get_ident()), None)
            if start is not None:
                self.spans.append((start, end, dev))


def union(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The intervals clipped to [lo, hi] and merged (sorted, disjoint)."""
    out: list[list[int]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(merged: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in merged)


def intersection(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(x) and j < len(y):
        total += max(0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _device_kind(name: str) -> str:
    """A device event by its CUPTI name: "Memcpy HtoD (Pinned -> Device)", "Memset (Device)", a kernel."""
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    return "other" if "Memcpy" in name or "Memset" in name else "kernel"


def profiled_step(step) -> dict:
    """Run `step` under torch.profiler (CUDA activity; CPU activity on a CPU-only smoke run) with the
    optimizer hooks; return the timeline summary in milliseconds."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acc = get_accelerator()
    with OptimizerSpans() as opt_spans:
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            acc.synchronize()
            t0 = time.time_ns()
            step()
            acc.synchronize()
            t1 = time.time_ns()
    spans = {"kernel": [], "h2d": [], "d2h": [], "other": []}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA:
            spans[_device_kind(e.name())].append((e.start_ns(), e.start_ns() + e.duration_ns()))
    kernels, h2d, d2h, other = spans["kernel"], spans["h2d"], spans["d2h"], spans["other"]
    compute = union(kernels, t0, t1)
    busy = union(kernels + h2d + d2h + other, t0, t1)
    host_opt = union([(a, b) for a, b, dev in opt_spans.spans if dev == "cpu"], t0, t1)
    ms = 1e-6
    return {
        "wall": (t1 - t0) * ms,
        # (a check that the device's clock and the host's agree: kernels start after t0, end before t1)
        "kernels_from": (min((a for a, _ in kernels), default=t0) - t0) * ms,
        "kernels_to": (max((b for _, b in kernels), default=t1) - t1) * ms,
        "compute": length(compute) * ms,
        "h2d": length(union(h2d, t0, t1)) * ms,
        "d2h": length(union(d2h, t0, t1)) * ms,
        "host_opt": length(host_opt) * ms,
        "host_opt_hidden": intersection(host_opt, compute) * ms,
        "idle": (t1 - t0 - length(busy)) * ms,
        "device": "cuda" if cuda else "none",
    }


# -- one trial ----------------------------------------------------------------------------------------
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


def _dims(args) -> tuple[int, int]:
    return (SMOKE_VOCAB, SMOKE_SEQ) if args.smoke else (VOCAB, SEQ)


def try_size(mode: str, shape, gas: int, args) -> dict:
    import zerospeed
    from zoo.models import GPT, GPTConfig

    layers, width, heads = shape
    vocab, seq = _dims(args)
    cfg = config(mode, args.micro_batch, gas, args.nvme_path)
    if args.smoke:
        cfg["zero_optimization"].get("offload_param", {}).update(buffer_size=1_000_000)
    acc = get_accelerator()
    build_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # fast random init
    gpt = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, bias=False)
    if cfg["zero_optimization"]["stage"] == 3:
        with build_on, zerospeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
            model = GPT(gpt)
    else:
        with build_on:
            model = GPT(gpt).to(torch.bfloat16)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    x = torch.randint(0, vocab, (args.micro_batch, seq), device=engine.device)

    def step():
        for _ in range(gas):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        return loss

    try:
        # (the phase timers, wall_clock_breakdown, count the timed steps only)
        times, loss = _timed_steps(step, args.steps, after_warmup=engine.observer.timers.reset)
        phases = engine.observer.timers.breakdown(args.steps)
        timeline = profiled_step(step)
        placement = engine.placement()
    finally:
        engine.destroy()
    return _result(shape, gas, args, times, loss, acc) | {
        "placement": placement,
        "phases_ms": phases,
        "timeline": timeline,
    }


def _result(shape, gas, args, times, loss, acc) -> dict:
    layers, width, _ = shape
    vocab, seq = _dims(args)
    step = statistics.median(times[1:])
    n = n_params(layers, width, vocab, seq)
    flops = (6 * n + 12 * layers * seq * width) * args.micro_batch * seq * gas
    return {
        "params": n,
        "step_s": step,
        "tflops": flops / step / 1e12,
        "gpu_peak_gib": acc.max_memory_allocated() / 2**30,
        "loss": loss.item(),
    }


def try_fsdp2(mode: str, shape, gas: int, args) -> dict:
    """PyTorch's FSDP2 at the same size, on one device: `fully_shard` on every block and the root, bf16
    compute with fp32 sharded parameters and gradient reduction (MixedPrecisionPolicy), AdamW (fused),
    gradient clipping; `fsdp2_cpu`: CPUOffloadPolicy (pinned), the parameters, gradients and the
    optimizer step on the host. The same model, batch, accumulation and step count as `try_size`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from zoo.models import GPT, GPTConfig

    layers, width, heads = shape
    vocab, seq = _dims(args)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    acc = get_accelerator()
    mesh = init_device_mesh(dev.type, (1,))
    offload = mode == "fsdp2_cpu"
    policy = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=dev.type == "cuda") if offload else OffloadPolicy(),
    )
    with dev:
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, bias=False))
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (args.micro_batch, seq), device=dev)

    def step():
        for _ in range(gas):
            loss = model(x, x)
            (loss / gas).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, loss = _timed_steps(step, args.steps)  # (the model is freed on return; the caller empties the cache)
    timeline = profiled_step(step)
    placement = "all on the host (CPUOffloadPolicy)" if offload else f"all on {dev.type}"
    return _result(shape, gas, args, times, loss, acc) | {"placement": placement, "phases_ms": {}, "timeline": timeline}


# -- the ladder, within the budget -------------------------------------------------------------------
class Log(list):
    """The result rows; each is also printed to stderr as it comes, so a run cut short still shows them."""

    def append(self, row) -> None:
        mode, shape, n, what = row
        print(f"[offload_largest] {mode} {shape or ''} {n / 1e9:.2f}B: {what}", file=sys.stderr, flush=True)
        super().append(row)


def fits(mode: str, shape, args, gpu_total: float) -> str | None:
    """Why this size cannot fit in this mode's memories (None: it fits by the formulas)."""
    layers, width, _ = shape
    vocab, seq = _dims(args)
    n = n_params(layers, width, vocab, seq)
    host, disk = needs(mode, n)
    dev = device_needs(mode, shape, args.micro_batch, seq, vocab)
    free_host = psutil.virtual_memory().available
    free_disk = shutil.disk_usage(args.nvme_path).free
    # (host states are pinned: page-locked memory cannot be swapped out, so a quarter stays free)
    if host > 0.75 * free_host or disk > 0.9 * free_disk or dev > gpu_total:
        return (
            f"needs {dev / 2**30:.0f} GiB device / {host / 2**30:.0f} GiB host / {disk / 2**30:.0f} GiB disk, "
            f"{gpu_total / 2**30:.0f} / {free_host / 2**30:.0f} / {free_disk / 2**30:.0f} free"
        )
    return None


def estimate_s(mode: str, shape, gas: int, rates: Rates, args) -> float:
    """Build (host states written at ~3 GB/s, pinned) + warm-up + timed + profiled steps."""
    layers, width, _ = shape
    vocab, seq = _dims(args)
    n = n_params(layers, width, vocab, seq)
    per_micro = (6 * n + 12 * layers * seq * width) * args.micro_batch * seq
    step = gas * rates.micro_s(mode, n, per_micro) + rates.host_step_s(mode, n)
    return 3.0 + needs(mode, n)[0] / 3e9 + (args.steps + 2) * step


def run_mode(mode: str, args, rates: Rates, share_s: float, gpu_total: float, log: Log, partner=None) -> dict | None:
    """The largest size of `mode` that trains (FSDP2: its partner's size only); None if none did."""
    ladder = SMOKE_LADDER if args.smoke else LADDER
    if partner is not None:
        ladder = [partner["shape"]]
    vocab, seq = _dims(args)
    larger_fit = None  # a size that fitted in memory but not in the time share
    started = time.monotonic()
    for shape in reversed(ladder):
        n = n_params(shape[0], shape[1], vocab, seq)
        why = fits(mode, shape, args, gpu_total)
        cap = args.caps.get(mode, float("inf"))
        if n > cap and partner is None:
            log.append((mode, shape, n, f"skipped: above --cap {mode}={cap / 1e9:g}B"))
            continue
        if why is not None:
            log.append((mode, shape, n, f"skipped: {why}"))
            continue
        per_micro = (6 * n + 12 * shape[0] * seq * shape[1]) * args.micro_batch * seq
        gas, gas_why = (
            (partner["gas"], "its zerospeed partner's") if partner else choose_gas(mode, n, per_micro, rates, args)
        )
        left = share_s - (time.monotonic() - started)
        est = estimate_s(mode, shape, gas, rates, args)
        if est > left and not (args.smoke and shape == ladder[0]):
            log.append((mode, shape, n, f"not tried: ~{est:.0f} s estimated, {left:.0f} s left of this mode's share"))
            larger_fit = larger_fit or shape
            continue
        get_accelerator().reset_peak_memory_stats()
        try:
            r = (try_fsdp2 if mode.startswith("fsdp2") else try_size)(mode, shape, gas, args)
        except torch.OutOfMemoryError:
            log.append((mode, shape, n, "device out of memory"))
            continue
        except RuntimeError as err:  # e.g. pinning more host memory than the OS grants
            log.append((mode, shape, n, f"failed: {str(err).splitlines()[0][:160]}"))
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                if hasattr(torch._C, "_host_emptyCache"):  # pinned host blocks the caching allocator kept
                    torch._C._host_emptyCache()
        r |= {"shape": shape, "gas": gas, "gas_why": gas_why, "larger_fit": larger_fit}
        t = r["timeline"]
        print(
            f"[offload_largest] {mode} timeline (ms): "
            + ", ".join(f"{k} {v:.0f}" for k, v in t.items() if k != "device"),
            file=sys.stderr,
            flush=True,
        )
        if mode == "none" and not args.smoke:  # calibrate the device rate for the later estimates
            rates.flops = r["tflops"] * 1e12
        phases = " / ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items())
        log.append(
            (
                mode,
                shape,
                n,
                f"ok: gas {gas}, {r['step_s'] * 1e3:.0f} ms/step{f' ({phases} ms)' if phases else ''}, "
                f"{r['tflops']:.2f} TFLOPs, device peak {r['gpu_peak_gib']:.1f} GiB, state: {r['placement']}",
            )
        )
        return r
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", default="/tmp/zerospeed_nvme")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up (and before the profiled one)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-fsdp2", action="store_true", help="skip PyTorch FSDP2 (with and without CPUOffloadPolicy)")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time; each mode gets a share")
    p.add_argument("--gas", type=int, default=0, help="gradient accumulation for every mode (default: chosen)")
    p.add_argument("--max-gas", type=int, default=8)
    p.add_argument(
        "--cap",
        nargs="*",
        default=[],
        metavar="MODE=BILLIONS",
        help="largest size to try in a mode, e.g. nvme=0.4 (the NVMe mode moves every state each step)",
    )
    p.add_argument("--fsdp2", action="store_true", help="(the default now: kept for older command lines)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on whatever device there is (a check)")
    args = p.parse_args()
    args.caps = {ALIASES.get(m, m): float(b) * 1e9 for m, b in (c.split("=") for c in args.cap)}
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
    start = time.monotonic()
    modes = [ALIASES.get(m, m) for m in args.modes.split(",") if m]
    fsdp2 = [] if args.no_fsdp2 else [f for f, partner in FSDP2_PARTNER.items() if partner in modes]
    gpu_total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else float("inf")
    rates = Rates(args.smoke)
    log, results = Log(), {}
    queue = modes + fsdp2
    # a trial that overruns its estimate is cut 30 s after the budget, and the report still printed
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(int(args.budget_s) + 30)
    mode = None
    try:
        for i, mode in enumerate(queue):
            share = (args.budget_s - (time.monotonic() - start)) / (len(queue) - i)
            partner = results.get(FSDP2_PARTNER.get(mode)) if mode.startswith("fsdp2") else None
            if mode.startswith("fsdp2") and partner is None:
                log.append((mode, None, 0, f"not run: {FSDP2_PARTNER[mode]} trained no size"))
                continue
            results[mode] = run_mode(mode, args, rates, share, gpu_total, log, partner)
    except _OutOfTime:
        log.append((mode, None, 0, f"cut: the run passed --budget-s {args.budget_s:.0f} + 30 s"))
    finally:
        signal.alarm(0)
    text = report(args, modes + fsdp2, results, log, rates, time.monotonic() - start)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


class _OutOfTime(Exception):
    pass


def _out_of_time(*_):
    raise _OutOfTime()


def report(args, modes, results, log, rates, elapsed) -> str:
    vocab, seq = _dims(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (--smoke on the CPU)"
    lines = [
        f"GPU: {device}, host RAM {psutil.virtual_memory().total / 2**30:.0f} GiB, {os.cpu_count()} host cores, "
        f"torch {torch.__version__}; GPT vocab {vocab}, micro batch {args.micro_batch} x seq {seq}, bf16, AdamW, "
        f"clipping 1.0, 1 process; {elapsed:.0f} s of a {args.budget_s:.0f} s budget; host fused AdamW measured "
        f"{rates.adam / 1e9:.2f} Gparams/s",
        "",
        "| mode | largest that trained | params | grad accum (why) | step ms | model TFLOPs | device peak GiB |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for mode in modes:
        r = results.get(mode)
        if r is None:
            lines.append(f"| {mode} | none | | | | | |")
            continue
        what = f"{r['shape'][0]} x {r['shape'][1]}"
        if r["larger_fit"]:
            what += f" (time-capped: {r['larger_fit'][0]} x {r['larger_fit'][1]} fits in memory)"
        lines.append(
            f"| {mode} | {what} | {r['params'] / 1e9:.2f}B | {r['gas']} ({r['gas_why']}) | {r['step_s'] * 1e3:.0f} | "
            f"{r['tflops']:.2f} | {r['gpu_peak_gib']:.1f} |"
        )
    for f, partner in FSDP2_PARTNER.items():
        if results.get(f) and results.get(partner):
            ratio = results[partner]["step_s"] / results[f]["step_s"]
            lines.append(f"\n{partner} step time / {f} step time at the same size and accumulation: {ratio:.2f}")
    lines += [
        "",
        "Timeline of one profiled step (ms; device = union of kernels + copies; host optimizer = union of CPU "
        "optimizer.step() spans on any thread; hidden = host optimizer time overlapping device compute):",
        "",
        "| mode | step | device compute | H2D | D2H | host optimizer | of it hidden | device idle | idle % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        r = results.get(mode)
        if r is None:
            continue
        t = r["timeline"]
        lines.append(
            f"| {mode} | {t['wall']:.0f} | {t['compute']:.0f} | {t['h2d']:.0f} | {t['d2h']:.0f} | "
            f"{t['host_opt']:.0f} | {t['host_opt_hidden']:.0f} | {t['idle']:.0f} | "
            f"{100 * t['idle'] / max(t['wall'], 1e-9):.0f}% |"
        )
    lines += [
        "",
        "Every size tried or skipped:",
        "",
        "| mode | layers x width | parameters | result |",
        "|---|---|---:|---|",
    ]
    for mode, shape, n, what in log:
        lines.append(f"| {mode} | {'' if shape is None else f'{shape[0]} x {shape[1]}'} | {n / 1e9:.2f}B | {what} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
