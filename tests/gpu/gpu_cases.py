"""What the GPU tests run in their spawned ranks (and the plain-PyTorch references they compare to).

Everything here is device-agnostic: inputs go to `engine.device`, every tensor given to a collective
is created on it, and the references run on this rank's device. So the same functions also run on
the CPU under gloo (`run_distributed(..., backend="gloo")`), which is how they are checked on a
machine without a GPU. The models, configs and data are those of the CPU parity tests
(tests/dist/test_zero_parity.py, test_pipe_parity.py), imported from tests/dist (on sys.path,
see tests/conftest.py).
"""

from __future__ import annotations

import os

import test_zero_parity as zp
import torch

import zerospeed
from harness import reference_train, split_global_batch
from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.optim import build_lr_scheduler

STEPS = 10


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def exact_fp32() -> None:
    """fp32 parity needs real fp32 matmuls on the GPU (TF32 would cost ~1e-3 relative)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device() -> torch.device:
    return get_accelerator().torch_device(comm.get_local_rank())


def _cpu(obj):
    """Results travel to the pytest process by pickle: no CUDA tensors (they would start CUDA there)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


# -- ZeRO training (the model / data / config of test_zero_parity) -----------------------------------


def train(config: dict, steps: int = STEPS):
    """Train test_zero_parity's model through the engine; returns (engine, per-step mean loss over ranks)."""
    model = zp.build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=zp.param_groups(model), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for batch in zp.global_batches(world, steps):
        total = 0.0
        for x, y in split_global_batch(batch, world, zp.GAS, rank):
            loss = engine(x.to(engine.device), y.to(engine.device))
            total += loss.item()
            engine.backward(loss)
            engine.step()
        t = torch.tensor([total / zp.GAS], device=engine.device)  # NCCL reduces device tensors only
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    return engine, losses


def final_state(engine) -> dict:
    """The full fp32 weights (on rank 0 only for stage 3, which gathers them there), on the host."""
    if engine.zero_optimization_stage() == 3:
        return {k: v.float().cpu() for k, v in engine.zero.full_state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


def reference(world: int, steps: int = STEPS, dev: torch.device | None = None) -> tuple[list[float], dict]:
    """test_zero_parity.reference, on `dev`: one plain PyTorch process, the same global batches."""
    dev = dev or device()
    model = zp.build_model().to(dev)
    opt = torch.optim.AdamW(zp.param_groups(model), lr=3e-3, weight_decay=0.0)
    sched = build_lr_scheduler(zp.SCHED["type"], dict(zp.SCHED["params"]), opt)
    batches = [(x.to(dev), y.to(dev)) for x, y in zp.global_batches(world, steps)]
    losses = reference_train(model, opt, batches, world_size=world, grad_accum=zp.GAS, scheduler=sched, clip=1.0)
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def parity_ranks(stages: list[int], steps: int = STEPS) -> dict:
    """Each ZeRO stage in turn (fp32); rank 0 adds the plain PyTorch reference, run on its own GPU."""
    exact_fp32()
    out = {}
    for stage in stages:
        engine, losses = train(zp.zero_config(stage), steps)
        out[stage] = {
            "losses": losses,
            "state": final_state(engine),
            "placement": engine.placement(),
            "device": str(engine.device),
        }
        engine.destroy()
    if comm.get_rank() == 0:
        out["reference"] = reference(comm.get_world_size(), steps)
    return _cpu(out)


def precision_ranks(stages: list[int], steps: int = STEPS) -> dict:
    """bf16 and fp16 runs of each stage, and the plain fp32 PyTorch reference on the same device."""
    exact_fp32()
    out = {}
    for stage in stages:
        for name, extra in [
            ("bf16", {"bf16": {"enabled": True}}),
            ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 10}}),
        ]:
            engine, losses = train(zp.zero_config(stage, **extra), steps)
            params = [p for p in engine.module.parameters() if p.requires_grad]
            masters = [m for g in engine.optimizer.param_groups for m in g["params"]]
            out[(stage, name)] = {
                "losses": losses,
                "skipped": engine.skipped_steps,
                "param_dtypes": {str(p.dtype) for p in params},
                "param_devices": {p.device.type for p in params},
                "master_dtypes": {str(m.dtype) for m in masters},
                "master_devices": {m.device.type for m in masters},
            }
            engine.destroy()
    out["reference"] = reference(comm.get_world_size(), steps)[0]
    return _cpu(out)


# -- offload ---------------------------------------------------------------------------------------


def _offload_config(stage: int, opt: dict | None, param: dict | None) -> dict:
    cfg = zp.zero_config(stage)
    if opt is not None:
        cfg["zero_optimization"]["offload_optimizer"] = opt
    if param is not None:
        cfg["zero_optimization"]["offload_param"] = param
    return cfg


def _tensors_of_state(optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def offload_ranks(stage: int, opt: dict | None, param: dict | None, steps: int = STEPS) -> dict:
    """The same run without and with offload; where the offloaded state lives, and whether it is pinned."""
    exact_fp32()
    base, base_losses = train(zp.zero_config(stage), steps)
    base_placement = base.placement()
    base.destroy()
    engine, losses = train(_offload_config(stage, opt, param), steps)
    masters = [m for g in engine.optimizer.param_groups for m in g["params"] if m.numel() > 0]
    states = [t for t in _tensors_of_state(engine.optimizer) if t.numel() > 1]  # not the scalar `step`
    out = {
        "base": base_losses,
        "losses": losses,
        "base_placement": base_placement,
        "placement": engine.placement(),
        "swap_files": [str(p) for _, p, _ in engine.swap_files()],
        "masters": [(m.device.type, m.is_pinned()) for m in masters],
        "states": sorted({t.device.type for t in states}),
        "model_devices": sorted({p.device.type for p in engine.module.parameters()}),
    }
    flat = getattr(engine.zero, "flat", None) if engine.zero_optimization_stage() == 3 else None
    if flat:  # stage 3: the parameter shards and the fp32 gradient shards of every flat parameter
        out["shards"] = [(fp.shard.device.type, fp.shard.is_pinned()) for fp in flat if fp.shard is not None]
        out["grad_shards"] = [
            (fp.grad_shard.device.type, fp.grad_shard.is_pinned()) for fp in flat if fp.grad_shard is not None
        ]  # (frozen flat parameters have none)
    engine.destroy()
    out["left"] = [f for f in out["swap_files"] if os.path.exists(f)]
    return _cpu(out)


def overlap_ranks(stage: int, param: dict | None, steps: int = STEPS) -> dict:
    """The same offloaded run with `offload_optimizer.overlap_step` off and on (at stage 3 with parameter
    offload, on means `engine.step()` returns before the last host steps: Note [deferred tail] in
    zerospeed/optim/sub_group_step.py): losses and the final weights, and whether the step defers its tail."""
    exact_fp32()
    out = {}
    for overlap in (False, True):
        opt = {"device": "cpu", "pin_memory": True, "overlap_step": overlap}
        engine, losses = train(_offload_config(stage, opt, param), steps)
        out[overlap] = {
            "losses": losses,
            "state": final_state(engine),
            "deferred": bool(getattr(engine.zero, "_defers", False)),
        }
        engine.destroy()
    return _cpu(out)


# -- zero.Init ---------------------------------------------------------------------------------------


def offload_states_ranks(stages: list[int]) -> dict:
    """engine.offload_states() after training (fp32, one rank): device memory before, offloaded and
    reloaded (torch.cuda's own count), the host copies' pinning, and the weights after the round trip;
    rank 0 adds the plain PyTorch reference."""
    from zerospeed.offload.states import OffloadStateTypeEnum, get_state_devices

    exact_fp32()
    out = {}
    for stage in stages:
        engine, _ = train(zp.zero_config(stage))
        numel = sum(p.numel() for p in zp.build_model().parameters() if p.requires_grad)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.offload_states(non_blocking=True)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        devices = {k.value: sorted(str(d) for d in get_state_devices(engine, k)) for k in OffloadStateTypeEnum}
        pinned = [b.is_pinned() for _, b, _ in engine.state_offloader.held.values() if b is not None]
        engine.reload_states(non_blocking=True)
        torch.cuda.synchronize()
        out[stage] = {
            "before": before,
            "after": after,
            "reloaded": torch.cuda.memory_allocated(),
            "numel": numel,
            "devices": devices,
            "pinned": pinned,
            "state": final_state(engine),
        }
        engine.destroy()
    if comm.get_rank() == 0:
        out["reference"] = reference(comm.get_world_size())
    return _cpu(out)


def zero_init_ranks() -> dict:
    """zero.Init of a CPU-built model: where the shards live, exactness, the modifier broadcast, training."""
    from test_zero3_api import BIG, CFG3

    from zerospeed import zero
    from zerospeed.zero import tags
    from zoo.models import GPT, GPTConfig

    exact_fp32()
    torch.manual_seed(0)
    eager = {k: v.clone() for k, v in GPT(BIG).state_dict().items()}
    out = {}
    for name, kwargs in [("device", {}), ("host", {"remote_device": "cpu", "pin_memory": True})]:
        torch.manual_seed(0)
        with zero.Init(**kwargs):
            model = GPT(BIG)  # built on the host, as most scripts do
        owners = {id(o): o for p in model.parameters() if (o := tags.owner_of(p)) is not None}.values()
        with zero.GatheredParameters(list(model.parameters())):
            state = model.state_dict()
            same = all(torch.equal(state[k].cpu(), v) for k, v in eager.items())
            full_devices = sorted({state[k].device.type for k in eager})
        out[name] = {
            "shards": sorted({(o.shard.device.type, o.shard.is_pinned()) for o in owners}),
            "same": same,
            "full_devices": full_devices,
            "host_rng_after": torch.get_rng_state(),
        }
    torch.manual_seed(0)
    GPT(BIG)
    out["eager_rng_after"] = torch.get_rng_state()  # the replayed init drew from the host generator too

    small = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    with zero.Init():
        model = GPT(small)
    w = model.ln_f.weight
    with zero.GatheredParameters(w, modifier_rank=comm.get_world_size() - 1):
        if comm.get_rank() == comm.get_world_size() - 1:
            w.data.fill_(7.0)
    with zero.GatheredParameters(w):
        out["modified"] = w.detach().clone()

    def losses_of(init: bool) -> list[float]:
        torch.manual_seed(0)
        if init:
            with zero.Init():
                m = GPT(small)
        else:
            m = GPT(small)
        engine, *_ = zerospeed.initialize(model=m, config=CFG3)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(comm.get_rank())).to(engine.device)
        got = []
        for _ in range(3):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        engine.destroy()
        return got

    out["train_eager"], out["train_init"] = losses_of(False), losses_of(True)
    return _cpu(out)


# -- pipeline ------------------------------------------------------------------------------------------


def pipe_ranks(cases: list[tuple]) -> dict:
    """test_pipe_parity's pipelines (NCCL p2p between stages); rank 0 adds the references on its GPU."""
    import test_pipe_parity as tp

    exact_fp32()
    results = [_cpu(tp.train_pipe(*case)) for case in cases]
    refs = {}
    if comm.get_rank() == 0:
        for pp, gas, *_ in cases:
            dp = comm.get_world_size() // pp
            if (dp, gas) not in refs:
                refs[(dp, gas)] = _cpu(pipe_reference(dp, gas))
    return {"results": results, "references": refs}


def pipe_reference(dp: int, gas: int) -> dict:
    import test_pipe_parity as tp

    dev = device()
    model = tp.build_gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=tp.LR, weight_decay=0.0)
    batches = [(x.to(dev), y.to(dev)) for x, y in tp.global_batches(dp, gas)]
    losses = reference_train(model, opt, batches, world_size=dp, grad_accum=gas, clip=1.0)
    with torch.no_grad():
        x, y = tp.global_batches(dp, gas, 1)[0]
        eval_loss = model(x.to(dev), y.to(dev)).item()
    return {"losses": losses, "eval": eval_loss, "wte": model.wte.weight.detach()}


# -- activation checkpointing ------------------------------------------------------------------------


def _ckpt_step(blocks, x, checkpointed: bool, seed: int):
    """test_activation_checkpointing_dist.step, also reporting where each kept input is and whether it
    is pinned: (gradients on the host, [(device type, pinned, original device, partitioned, numel)])."""
    from zerospeed import checkpointing
    from zerospeed.activation.stash import SavedInput

    torch.manual_seed(seed)  # the host and every GPU generator: the same dropout masks as the reference
    for p in blocks.parameters():
        p.grad = None
    x.grad = None
    h, kept = x, []
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h) if checkpointed else blk(h)
        if checkpointed:
            kept += [
                (s.data.device.type, s.data.is_pinned(), str(s.device), s.partitioned, s.data.numel())
                for s in h.grad_fn.saved
                if isinstance(s, SavedInput)
            ]
    (h * h).mean().backward()
    return [p.grad.detach().cpu().clone() for p in blocks.parameters()] + [x.grad.detach().cpu().clone()], kept


def _dropout_blocks():
    import test_activation_checkpointing_dist as ac

    blocks, x = ac.build()
    return blocks.to(device()), x.detach().to(device()).requires_grad_()


def _held_after_forward(cpu: bool, layers: int = 4, shape=(4, 256, 256)) -> tuple[int, int]:
    """Device bytes a checkpointed forward leaves allocated until its backward; one activation's bytes."""
    from zerospeed import checkpointing

    checkpointing.unconfigure()
    checkpointing.configure(checkpoint_in_cpu=cpu)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Linear(shape[-1], shape[-1]) for _ in range(layers)]).to(device())
    x = torch.randn(*shape, device=device())
    acc = get_accelerator()
    acc.synchronize()
    before = acc.memory_allocated()
    h = x
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h)
    acc.synchronize()
    held = acc.memory_allocated() - before
    h.float().pow(2).mean().backward()
    checkpointing.unconfigure()
    return held, x.nbytes


def cpu_checkpointing_ranks() -> dict:
    """cpu_checkpointing (alone and contiguous) on this rank's GPU, against the plain run on the same GPU."""
    import test_activation_checkpointing_dist as ac

    from zerospeed import checkpointing

    exact_fp32()
    blocks, x = _dropout_blocks()
    ref = [_ckpt_step(blocks, x, False, 100 + s)[0] for s in range(ac.STEPS)]
    out = {"reference": ref}
    for name, extra in [
        ("cpu", {}),
        ("cpu+contiguous", {"contiguous_checkpointing": True, "num_checkpoints": ac.N_BLOCKS}),
    ]:
        checkpointing.unconfigure()
        checkpointing.configure(checkpoint_in_cpu=True, **extra)
        blocks, x = _dropout_blocks()
        steps = [_ckpt_step(blocks, x, True, 100 + s) for s in range(ac.STEPS)]
        host = checkpointing.contiguous_buffer("cpu")
        out[name] = {
            "grads": [g for g, _ in steps],
            "kept": sorted({k for _, kept in steps for k in kept}),
            "n_kept": [len(kept) for _, kept in steps],
            "host_buffer": None if host is None else (host.numel(), host.is_pinned()),
            "device_buffer": checkpointing.contiguous_buffer(device()) is not None,
        }
    checkpointing.unconfigure()
    out["held_plain"], out["act_bytes"] = _held_after_forward(cpu=False)
    out["held_cpu"], _ = _held_after_forward(cpu=True)
    return _cpu(out)


def partitioned_checkpointing_ranks() -> dict:
    """partition_activations over a 2-rank model-parallel group on NCCL, with and without cpu_checkpointing."""
    import test_activation_checkpointing_dist as ac

    from harness.mpu import GroupMpu
    from zerospeed import checkpointing

    exact_fp32()
    mpu = GroupMpu(comm.new_group([0, 1]))
    blocks, x = _dropout_blocks()
    out = {"reference": [_ckpt_step(blocks, x, False, 100 + s)[0] for s in range(ac.STEPS)]}
    cases = {
        "partition": {},
        "partition+cpu": {"checkpoint_in_cpu": True},
        "partition+cpu+contiguous": {
            "checkpoint_in_cpu": True,
            "contiguous_checkpointing": True,
            "num_checkpoints": ac.N_BLOCKS,
        },
    }
    for name, extra in cases.items():
        checkpointing.unconfigure()
        checkpointing.configure(mpu, partition_activations=True, **extra)
        blocks, x = _dropout_blocks()
        grads, kept, gathers = [], set(), []
        for s in range(ac.STEPS):
            before = comm.STATS.snapshot().get("all_gather", {}).get("calls", 0)
            g, k = _ckpt_step(blocks, x, True, 100 + s)
            gathers.append(comm.STATS.snapshot().get("all_gather", {}).get("calls", 0) - before)
            grads.append(g)
            kept |= set(k)
        out[name] = {"grads": grads, "kept": sorted(kept), "gathers": gathers}
    checkpointing.unconfigure()
    return _cpu(out)


# -- the accelerator API (CUDA only: each answer next to torch.cuda's own) ----------------------------


def accelerator_api_ranks() -> dict[str, tuple]:
    """DeepSpeed's accelerator methods on this rank's GPU: name -> (accelerator's answer, torch.cuda's)."""
    acc, i = get_accelerator(), torch.cuda.current_device()
    major = torch.cuda.get_device_capability()[0]
    out = {
        "class": (type(acc).__name__, "CudaAccelerator"),
        "names": (
            (acc.device_name(), acc.device_name(i), acc.current_device_name()),
            ("cuda", f"cuda:{i}", f"cuda:{i}"),
        ),
        "current_device": ((type(acc.current_device()), acc.current_device()), (int, i)),
        "device": ((acc.device(i), acc.torch_device(0)), (torch.device("cuda", i), torch.device("cuda", 0))),
        "device_count": (acc.device_count(), torch.cuda.device_count()),
        "backend": (
            (acc.communication_backend_name(), acc.communication_backend_version()),
            ("nccl", torch.cuda.nccl.version()),
        ),
        "synchronized": (acc.is_synchronized_device(), False),
    }
    # random numbers
    acc.manual_seed(7)
    got = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(7)
    out["manual_seed"] = (torch.equal(got, torch.rand(8, device="cuda")), True)
    out["initial_seed"] = (acc.initial_seed(), torch.cuda.initial_seed())
    out["get_rng_state"] = (
        (
            torch.equal(acc.get_rng_state(), torch.cuda.get_rng_state()),
            torch.equal(acc.get_rng_state(i), torch.cuda.get_rng_state(i)),
        ),
        (True, True),
    )
    state = acc.get_rng_state(i)
    first = torch.rand(8, device="cuda")
    acc.set_rng_state(state, i)
    again = torch.equal(torch.rand(8, device="cuda"), first)
    acc.set_rng_state(state)
    out["set_rng_state"] = ((again, torch.equal(torch.rand(8, device="cuda"), first)), (True, True))
    out["default_generator"] = (acc.default_generator(i) is torch.cuda.default_generators[i], True)
    # memory, read back to back with torch's
    x = torch.ones(1024, 1024, device="cuda")
    acc.synchronize()
    out["memory_allocated"] = (
        (acc.memory_allocated(), acc.memory_allocated(i)),
        (torch.cuda.memory_allocated(), torch.cuda.memory_allocated(i)),
    )
    out["max_memory_allocated"] = (acc.max_memory_allocated(), torch.cuda.max_memory_allocated())
    out["memory_reserved"] = (
        (acc.memory_reserved(), acc.memory_cached(), acc.max_memory_reserved(), acc.max_memory_cached()),
        (torch.cuda.memory_reserved(),) * 2 + (torch.cuda.max_memory_reserved(),) * 2,
    )
    out["memory_stats"] = (
        acc.memory_stats()["allocated_bytes.all.current"],
        torch.cuda.memory_stats()["allocated_bytes.all.current"],
    )
    del x
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    out["reset_peak"] = (acc.max_memory_allocated(), torch.cuda.memory_allocated())
    out["total_memory"] = (acc.total_memory(), torch.cuda.get_device_properties(i).total_memory)
    free = torch.cuda.mem_get_info()[0]
    out["available_memory"] = (abs(acc.available_memory() - free) < 256 * 2**20, True)
    # streams, events, graphs
    s = acc.Stream()
    with acc.stream(s):
        inside = torch.cuda.current_stream() == s
    out["streams"] = (
        (
            acc.Stream,
            acc.Event,
            inside,
            acc.current_stream() == torch.cuda.current_stream(),
            acc.default_stream(i) == torch.cuda.default_stream(i),
        ),
        (torch.cuda.Stream, torch.cuda.Event, True, True, True),
    )
    static = torch.ones(16, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    for _ in range(2):  # warm up on a side stream, as graph capture wants
        with acc.stream(s):
            static * 2
    torch.cuda.synchronize()
    graph = acc.create_graph()
    with acc.capture_to_graph(graph):
        doubled = static * 2
    static.fill_(3.0)
    acc.replay_graph(graph)
    acc.synchronize()
    out["graph"] = ((type(graph), doubled.sum().item()), (torch.cuda.CUDAGraph, 96.0))
    # dtypes and tensors
    bf16, fp16 = torch.cuda.is_bf16_supported(), major >= 7
    dtypes = {torch.float32} | ({torch.float16} if fp16 else set()) | ({torch.bfloat16} if bf16 else set())
    out["dtypes"] = (
        (acc.is_bf16_supported(), acc.is_fp16_supported(), set(acc.supported_dtypes())),
        (bf16, fp16, dtypes),
    )
    pinned = acc.pin_memory(torch.ones(4))
    out["pinning"] = (
        (pinned.is_pinned(), acc.is_pinned(pinned), acc.pinned_empty(4, torch.float16).is_pinned()),
        (True, True, True),
    )
    t = acc.HalfTensor([1.0, 2.0])
    out["tensors"] = (
        (t.device.type, t.dtype, acc.on_accelerator(t), acc.on_accelerator(pinned)),
        ("cuda", torch.float16, True, False),
    )
    ran = []
    acc.lazy_call(lambda: ran.append(True))  # CUDA is initialised by now: it runs at once
    acc.range_push("accelerator_api")
    acc.range_pop()
    out["misc"] = ((ran, acc.is_triton_supported(), acc.amp() is torch.cuda.amp), ([True], major >= 8, True))
    return _cpu(out)
