"""One rank of one benchmark variant; started by bench_step.py, never by hand.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python workers.py '<spec json>'

Every variant trains the same GPT from the same seed on the same micro-batches (a
DistributedSampler over the stdlib corpus, built here rather than by the engine, so only the
training step differs), and writes ``<out_dir>/<variant>.rank<r>.json`` with its optimizer-step
times, losses and peak memory — and, for the zerospeed variants, the comm gateway's counters over the
measured steps.

Variants: ``zs0``..``zs3`` (zerospeed at ZeRO stage 0-3; ``zspp``: its PipelineEngine, one stage per rank;
``zs3_noprefetch`` with
``stage3_prefetch_bucket_size`` 0), ``ds0``..``ds3``/``ds3_noprefetch`` (DeepSpeed with the same config),
``ddp`` (PyTorch DDP + AdamW), ``ddp_zero`` (DDP + PyTorch's ZeroRedundancyOptimizer around AdamW,
i.e. PyTorch's own ZeRO-1) and ``fsdp2``/``fsdp2_noprefetch`` (PyTorch's ``fully_shard`` on the same
units as zerospeed's stage 3).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

from zoo.data import ByteSequenceDataset, stdlib_corpus
from zoo.models import GPT, GPTConfig

MODEL_SIZES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt4x256": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=4096),  # 4.24M parameters (issue 44's GPT)
}
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0


def build_model(spec: dict) -> GPT:
    torch.manual_seed(spec["seed"])
    return GPT(GPTConfig(block_size=spec["seq_len"], **MODEL_SIZES[spec["model_size"]]))


def micro_batches(spec: dict, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    dataset = ByteSequenceDataset(stdlib_corpus(spec["corpus_bytes"]), spec["seq_len"])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=spec["seed"])
    loader = DataLoader(dataset, batch_size=spec["micro_batch"], sampler=sampler, drop_last=True)
    needed = (spec["warmup"] + spec["steps"]) * spec["grad_accum"]
    if len(loader) < needed:
        raise ValueError(
            f"corpus gives {len(loader)} micro-batches per rank, the run needs {needed}; "
            "raise --corpus-bytes or lower --steps"
        )
    return iter(loader)


def zero_section(spec: dict) -> dict:
    """``zero_optimization`` for the spec's stage; identical for zerospeed and DeepSpeed.

    Stage 0 gets only the reduce bucket: neither library reads the all-gather bucket or
    ``overlap_comm`` there (zerospeed's stage 0 always overlaps its all-reduce with backward).
    Stage 3 gets the prefetch bucket, the persistence threshold and the live-parameter cap instead of
    the all-gather bucket (parameters are gathered per unit, not per bucket).
    """
    zero = {"stage": spec["stage"], "reduce_bucket_size": spec["reduce_bucket_size"]}
    if spec["stage"] in (1, 2):
        zero |= {"allgather_bucket_size": spec["allgather_bucket_size"], "overlap_comm": spec["overlap_comm"]}
    if spec["stage"] == 3:
        zero |= {
            "overlap_comm": spec["overlap_comm"],
            "stage3_prefetch_bucket_size": spec["prefetch_bucket_size"],
            "stage3_param_persistence_threshold": spec["param_persistence_threshold"],
            "stage3_max_live_parameters": spec["max_live_parameters"],
        }
    offload = spec.get("offload", "none")
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if spec["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif offload in ("nvme", "nvmeall"):
        nvme = {"device": "nvme", "nvme_path": spec["nvme_path"], "pin_memory": True}
        zero["offload_optimizer"] = nvme | {"pipeline_read": True, "pipeline_write": True}
        if offload == "nvmeall":
            zero["offload_param"] = nvme | {"buffer_count": 5, "buffer_size": 100_000_000}
    return zero


def ds_config(spec: dict, torch_adam: bool) -> dict:
    """The DeepSpeed config shared by the zerospeed and DeepSpeed variants (no LR schedule)."""
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}
    if torch_adam:
        params["torch_adam"] = True  # DeepSpeed's fused CPU Adam needs a compiled op
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["grad_accum"],
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero_section(spec),
        "steps_per_print": 10**9,
    }


def timed_steps(
    spec: dict,
    batches,
    micro_step: Callable,
    optimizer_step: Callable,
    sync: Callable[[], None],
    on_measure: Callable[[], None] = lambda: None,
) -> dict:
    """Run warmup + steps optimizer steps; time each from its first micro-batch to the update.

    ``on_measure`` runs once, after the warm-up and before the first measured step (counter resets).
    """
    times, losses = [], []
    gas = spec["grad_accum"]
    for i in range(spec["warmup"] + spec["steps"]):
        sync()
        if i == spec["warmup"]:
            on_measure()
        start, total = time.perf_counter(), 0.0
        for k in range(gas):
            x, y = next(batches)
            total += micro_step(x, y, k == gas - 1)
        optimizer_step()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(total / gas)
    return {"step_times": times[spec["warmup"] :], "losses": losses}


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_engine(spec: dict, rank: int, world: int, lib) -> dict:
    """zerospeed or DeepSpeed: the same DeepSpeed-style loop, the library swapped.

    For zerospeed the comm gateway's counters are reset after the warm-up and returned under
    ``"comm"`` ({kind: {calls, payload_bytes, wire_bytes, seconds, algbw_GBps}}, all measured steps).
    """
    # DeepSpeed runs torch's Adam unless offloading, where its compiled CPUAdam is its own configuration
    # (it JIT-builds once, ~4 min here, then loads from the torch extensions cache)
    use_torch_adam = lib.__name__ == "deepspeed" and spec.get("offload", "none") == "none"
    if lib.__name__ == "deepspeed":
        lib.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    else:
        lib.init_distributed()
    model = build_model(spec)
    sizes = param_sizes(model)  # before the engine: at stage 3 it leaves the parameters empty
    engine, *_ = lib.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(spec, torch_adam=use_torch_adam)
    )
    if spec.get("compile"):
        engine.compile()
    device = engine.device

    def micro_step(x, y, boundary):
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()  # updates only at the accumulation boundary, as in DeepSpeed
        return loss.item()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stats = None if lib.__name__ == "deepspeed" else lib.comm.STATS
    result = timed_steps(
        spec,
        micro_batches(spec, rank, world),
        micro_step,
        lambda: None,
        sync,
        on_measure=stats.reset if stats is not None else (lambda: None),
    )
    if stats is not None:
        result["comm"] = stats.snapshot()
    return result | sizes | {"peak_memory": peak_memory(device)}


def run_pipeline(spec: dict, rank: int, world: int, lib) -> dict:
    """zerospeed's PipelineEngine: the same GPT as `world` pipeline stages (its layer list, zoo/gpt_layers.py,
    started from the same weights), one `train_batch` per optimizer step over the accumulation's micro-batches.
    Every rank feeds the same data (one data-parallel replica)."""
    from zerospeed.pipe import PipelineModule
    from zoo.gpt_layers import gpt_layer_specs, lm_loss

    lib.init_distributed()
    source = build_model(spec)
    sizes = param_sizes(source)
    module = PipelineModule(
        gpt_layer_specs(source.config, source), num_stages=world, loss_fn=lm_loss, partition_method="parameters"
    )
    engine, *_ = lib.initialize(
        model=module, config=ds_config(spec, torch_adam=False) | {"zero_optimization": {"stage": 0}}
    )
    pending, last = [], [0.0]

    def micro_step(x, y, boundary):
        pending.append((x, y))
        if not boundary:
            return 0.0
        last[0] = float(engine.train_batch(iter(list(pending))))
        pending.clear()
        return last[0] * spec["grad_accum"]  # timed_steps averages over the micro-batches

    stats = lib.comm.STATS
    result = timed_steps(
        spec, micro_batches(spec, 0, 1), micro_step, lambda: None, lambda: None, on_measure=stats.reset
    )
    result["comm"] = stats.snapshot()
    return result | sizes | {"peak_memory": peak_memory(engine.device)}


def param_sizes(model: torch.nn.Module) -> dict:
    """Parameter elements (tied ones once), element size, and the elements of tied parameters (a
    parameter registered by more than one module: stage 3 gathers it again for the second user)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    params = {id(p): p for p in model.parameters()}
    return {
        "params": sum(p.numel() for p in params.values()),
        "param_bytes": next(iter(params.values())).element_size(),
        "tied_params": sum(params[i].numel() for i, n in seen.items() if n > 1),
    }


def _run_plain_torch(spec, rank, world, micro_step, model, opt, cuda) -> dict:
    """The DDP / FSDP2 baselines' shared loop: clip, step, zero; timed; process group torn down."""
    import torch.distributed as dist

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = timed_steps(spec, micro_batches(spec, rank, world), micro_step, optimizer_step, sync)
    dist.destroy_process_group()
    return result


def run_ddp(spec: dict, rank: int, world: int, zero: bool) -> dict:
    """The PyTorch baseline: DDP, no_sync on non-boundary micro-steps, AdamW, clipping.

    With ``zero`` the AdamW is wrapped in ``ZeroRedundancyOptimizer`` (PyTorch's ZeRO-1: each rank
    keeps and steps the optimizer state of its share of the parameters, then broadcasts them).
    """
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and os.environ.get("ZEROSPEED_ACCELERATOR", "") != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    model = DDP(build_model(spec).to(device), device_ids=[device.index] if cuda else None)
    if spec.get("compile"):
        model.compile()
    hparams = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hparams)
    else:
        opt = torch.optim.AdamW(model.parameters(), **hparams)
    gas = spec["grad_accum"]

    def micro_step(x, y, boundary):
        with nullcontext() if boundary else model.no_sync():
            loss = model(x.to(device), y.to(device))
            (loss / gas).backward()  # DeepSpeed scales by 1/GAS too, so the updates match
        return loss.item()

    result = _run_plain_torch(spec, rank, world, micro_step, model, opt, cuda)
    return result | {"peak_memory": peak_memory(device)}


def shard_units(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """zerospeed's stage-3 units as FSDP2 groups: every module that directly owns parameters, children
    before parents. A parameter belongs to the first module (``modules()`` order) registering it; a
    later module that registers it too (the tied head) joins the owner's group, since FSDP2 cannot
    shard one parameter in two groups. The root is left out: its ``fully_shard`` comes last."""
    owner: dict[int, torch.nn.Module] = {}
    groups: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        own = list(m.parameters(recurse=False))
        taken = [owner[id(p)] for p in own if id(p) in owner]
        if taken:
            if taken[0] is not model:  # shared with the root: the root's fully_shard covers both
                groups[id(taken[0])].append(m)
        elif own and m is not model:
            groups[id(m)] = [m]
        for p in own:
            owner.setdefault(id(p), taken[0] if taken else m)
    return list(groups.values())[::-1]  # pre-order reversed: descendants before ancestors


def run_fsdp2(spec: dict, rank: int, world: int, prefetch: bool) -> dict:
    """PyTorch FSDP2: ``fully_shard`` on each unit of ``shard_units``, then on the root; AdamW on the
    sharded (DTensor) parameters; DTensor-aware ``clip_grad_norm_``.

    Gradients are reduce-scattered on every micro-step (FSDP2's default, as in zerospeed's and
    DeepSpeed's stage 3), not held unsharded with ``set_requires_gradient_sync(False)``, so the three
    have the same communication volume and gradient memory. Without ``prefetch``: the forward unshard
    runs on the current stream (``_set_unshard_async_op(True)``: no implicit all-gather-stream
    prefetch; on CPU there are no streams, so this changes nothing there) and the default backward
    prefetch of the previous module is replaced by an explicit self-prefetch, a no-op.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available() and os.environ.get("ZEROSPEED_ACCELERATOR", "") != "cpu"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    model = build_model(spec).to(device)
    sizes = param_sizes(model)
    sharded = [fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh) for unit in shard_units(model)]
    fully_shard(model, mesh=mesh)
    if spec.get("compile"):
        model.compile()
    if not prefetch:
        for unit in sharded:
            for m in unit if isinstance(unit, list) else [unit]:
                m._set_unshard_async_op(True)
                m.set_modules_to_backward_prefetch([m])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    gas = spec["grad_accum"]

    def micro_step(x, y, boundary):
        loss = model(x.to(device), y.to(device))
        (loss / gas).backward()
        return loss.item()

    result = _run_plain_torch(spec, rank, world, micro_step, model, opt, cuda)
    return result | sizes | {"peak_memory": peak_memory(device)}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    variant = spec["variant"]
    if variant in ("ddp", "ddp_zero"):
        result = run_ddp(spec, rank, world, zero=variant == "ddp_zero")
    elif variant in ("fsdp2", "fsdp2_noprefetch"):
        result = run_fsdp2(spec, rank, world, prefetch=variant == "fsdp2")
    elif variant == "zspp":
        import zerospeed

        result = run_pipeline(spec, rank, world, zerospeed)
    elif variant.startswith("zs"):
        import zerospeed

        result = run_engine(spec, rank, world, zerospeed)
    elif variant.startswith("ds"):
        import deepspeed

        result = run_engine(spec, rank, world, deepspeed)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    out = Path(spec["out_dir"]) / f"{spec['variant']}.rank{rank}.json"
    out.write_text(json.dumps(result | {"rank": rank, "threads": torch.get_num_threads()}))


def nvme_read_once_ms(files: list) -> float:
    """Median time to read the swap files once with O_DIRECT (the engine's own reader, 1 MiB blocks,
    queue depth 8) into pinned memory: the floor for a token whose weights all come from the disk."""
    from zerospeed.offload.aio import AsyncIO, aligned_empty

    total = sum(nbytes for _, _, nbytes in files)
    buf = aligned_empty(total, torch.uint8, pin=torch.cuda.is_available())
    times = []
    with AsyncIO() as aio:
        for _ in range(3):
            start = time.perf_counter()
            offset = 0
            reqs = []
            for _, path, nbytes in files:
                reqs.append(aio.read(buf[offset : offset + nbytes], path))
                offset += nbytes
            for r in reqs:
                r.wait()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


if __name__ == "__main__":
    main()
