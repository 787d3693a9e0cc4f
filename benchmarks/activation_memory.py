"""Activation memory and step time of a deep GPT block stack, with and without zerospeed.activation.

    python benchmarks/activation_memory.py [--blocks 16 --hidden 128 --seq 256 --batch 8 --steps 3]

Rows: no checkpointing; every block checkpointed; + cpu_checkpointing; + contiguous_memory_optimization;
+ both; then partition_activations over a model-parallel group of --mp-ranks processes (gloo on CPU,
each rank running the same replicated stack, as tensor-parallel ranks hold the same block inputs;
rank 0's numbers). Columns:

- end of forward: the independent census (harness.census: live tensor storages, deduplicated)
  after the loss is computed, before backward, minus the census before the forward. On an accelerator
  it is split into device and host bytes.
- sampled peak: the largest census seen at sample points - after every block's forward (also each
  recompute, which runs inside backward) and whenever a block's output gradient arrives - minus the
  same baseline. A sample, not a true peak: memory between two sample points is not seen.
- device peak: the accelerator's own peak counter over one step (CUDA only; "-" on CPU, where the
  only counter is the whole process's RSS).
- step: median wall time of forward + backward (no sampling) over --steps rounds; each round runs
  every variant once, in turn, so load from other processes hits all variants alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from harness import run_distributed
from harness.census import live_tensor_bytes
from harness.mpu import GroupMpu
from zerospeed import checkpointing, comm
from zerospeed.accelerator import get_accelerator
from zoo.models import Block, GPTConfig

VARIANTS: dict[str, dict | None] = {
    "no checkpointing": None,
    "checkpoint": {},
    "checkpoint + cpu": {"checkpoint_in_cpu": True},
    "checkpoint + contiguous": {"contiguous_checkpointing": True},
    "checkpoint + cpu + contiguous": {"checkpoint_in_cpu": True, "contiguous_checkpointing": True},
}
PARTITION_VARIANTS: dict[str, dict] = {
    "partition": {"partition_activations": True},
    "partition + cpu + contiguous": {
        "partition_activations": True,
        "checkpoint_in_cpu": True,
        "contiguous_checkpointing": True,
    },
}


def build(args, device) -> tuple[nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, n_layer=args.blocks, n_head=args.heads, n_embd=args.hidden)
    blocks = nn.ModuleList(Block(cfg) for _ in range(args.blocks)).to(device)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, requires_grad=True)
    return blocks, x


def forward(blocks: nn.ModuleList, x: torch.Tensor, checkpointed: bool, on_output=None) -> torch.Tensor:
    h = x
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h) if checkpointed else blk(h)
        if on_output is not None:
            on_output(h)
    return h.pow(2).mean()


class Census:
    """Census bytes relative to a baseline, per memory kind (device / host), with a running max."""

    def __init__(self, device: torch.device):
        self.kinds = ["cpu"] if device.type == "cpu" else [device.type, "cpu"]
        self.base = self._now()
        self.peak = dict.fromkeys(self.kinds, 0)

    def _now(self) -> dict[str, int]:
        return {k: live_tensor_bytes(k) for k in self.kinds}

    def delta(self) -> dict[str, int]:
        now = self._now()
        return {k: now[k] - self.base[k] for k in self.kinds}

    def sample(self, *_unused) -> None:
        for k, v in self.delta().items():
            self.peak[k] = max(self.peak[k], v)


def measure_memory(blocks, x, checkpointed: bool, device) -> tuple[dict, dict, int | None]:
    accel = get_accelerator()
    census = Census(device)
    hooks = [blk.register_forward_hook(census.sample) for blk in blocks]
    if device.type != "cpu":
        accel.synchronize()
        accel.reset_peak_memory_stats()
        device_before = accel.memory_allocated()
    loss = forward(blocks, x, checkpointed, on_output=lambda h: h.register_hook(census.sample))
    end_of_forward = census.delta()
    census.sample()
    loss.backward()
    device_peak = None
    if device.type != "cpu":
        accel.synchronize()
        device_peak = accel.max_memory_allocated() - device_before
    for h in hooks:
        h.remove()
    del loss
    return end_of_forward, census.peak, device_peak


def configure(name: str, args, mpu=None) -> bool:
    """Set the variant's policy; returns whether it checkpoints at all."""
    kwargs = VARIANTS[name] if name in VARIANTS else PARTITION_VARIANTS[name]
    checkpointing.unconfigure()
    if kwargs is None:
        return False
    if kwargs.get("contiguous_checkpointing"):
        kwargs = {**kwargs, "num_checkpoints": args.blocks}
    checkpointing.configure(mpu, **kwargs)
    return True


def partition_worker(args) -> dict[str, tuple]:
    """On each rank: memory and median step time of the partitioned variants."""
    device = get_accelerator().torch_device(comm.get_local_rank())
    blocks, x = build(args, device)
    mpu, out = GroupMpu(comm.new_group(list(range(comm.get_world_size())))), {}
    for name in PARTITION_VARIANTS:
        memory = measure_memory(blocks, x, configure(name, args, mpu), device)
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        times = [one_step_seconds(blocks, x, True) for _ in range(args.steps + 1)][1:]
        out[name] = (*memory, statistics.median(times))
    checkpointing.unconfigure()
    return out


def one_step_seconds(blocks, x, checkpointed: bool) -> float:
    accel = get_accelerator()
    accel.synchronize()
    start = time.perf_counter()
    forward(blocks, x, checkpointed).backward()
    accel.synchronize()
    elapsed = time.perf_counter() - start
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return elapsed


def step_seconds(blocks, x, args) -> dict[str, float]:
    """Median step time per variant; round-robin rounds after one warm-up step each."""
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rnd in range(args.steps + 1):
        for name in VARIANTS:
            elapsed = one_step_seconds(blocks, x, configure(name, args))
            if rnd > 0:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mp-ranks", type=int, default=2, help="model-parallel size of the partition rows (1: skip)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_accelerator().torch_device()
    blocks, x = build(args, device)
    one_input = x.numel() * x.element_size()
    print(
        f"{args.blocks} GPT blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32 on {device}; "
        f"one block input = {mib(one_input)} MiB; torch threads {torch.get_num_threads()}\n"
    )
    kinds = Census(device).kinds
    head = (
        " | ".join(f"end of forward {k} MiB" for k in kinds)
        + " | "
        + " | ".join(f"sampled peak {k} MiB" for k in kinds)
    )
    print(f"| variant | {head} | device peak MiB | step ms |")
    print("|---|" + "---:|" * (2 * len(kinds) + 2))
    memory = {}
    for name in VARIANTS:
        memory[name] = measure_memory(blocks, x, configure(name, args), device)
        blocks.zero_grad(set_to_none=True)
        x.grad = None
    seconds = step_seconds(blocks, x, args)
    rows = {name: (*memory[name], seconds[name]) for name in VARIANTS}
    if args.mp_ranks > 1:
        backend = get_accelerator().communication_backend_name()
        for name, row in run_distributed(partition_worker, args.mp_ranks, args, timeout=3600, backend=backend)[
            0
        ].items():
            rows[f"{name} ({args.mp_ranks} ranks)"] = row
    for name, (end, peak, device_peak, sec) in rows.items():
        cells = " | ".join(mib(end[k]) for k in kinds) + " | " + " | ".join(mib(peak[k]) for k in kinds)
        print(f"| {name} | {cells} | {mib(device_peak)} | {sec * 1e3:.0f} |")
    checkpointing.unconfigure()


if __name__ == "__main__":
    main()
