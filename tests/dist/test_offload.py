"""ZeRO-Offload and ZeRO-Infinity: CPU and NVMe offload of optimizer state and parameters.

Each scenario trains the same 2-rank job twice in one spawn — without offload and with it — and
requires identical losses (<= 1e-5 over 10 steps). It then checks where the state really is: the
engine's placement map, the swap files on disk (their sizes are the expected bytes), and an
independent census of live tensors (the bytes that left memory are the masters and optimizer
states, less the fixed host buffers the swapper reads them into).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from test_zero_parity import GAS, build_model, global_batches, param_groups, zero_config

import zerospeed
from harness import run_distributed, split_global_batch
from harness.census import live_tensor_bytes
from zerospeed import comm
from zerospeed.offload.swap import slot_nbytes

STEPS = 10


def _train(config, steps=STEPS):
    """Train; returns the engine, the losses and the live tensor bytes the job added (census)."""
    gc.collect()
    before = live_tensor_bytes()
    model = build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for batch in global_batches(world, steps):
        total = 0.0
        for x, y in split_global_batch(batch, world, GAS, rank):
            loss = engine(x.to(engine.device), y.to(engine.device))
            total += loss.item()
            engine.backward(loss)
            engine.step()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    del x, y, loss, batch
    return engine, losses, live_tensor_bytes() - before


def _offload(stage, opt=None, param=None, **zero_over):
    cfg = zero_config(stage)
    z = cfg["zero_optimization"]
    if opt is not None:
        z["offload_optimizer"] = opt
    if param is not None:
        z["offload_param"] = param
    z.update(zero_over)
    return cfg


def _offloaded(base, stage, opt, param, zero_over):
    """The offloaded run of `stage` against its `base` run: losses, placement, swap files and memory."""
    engine, losses, nbytes = _train(_offload(stage, opt, param, **zero_over))
    files = [(kind, str(path), nbytes, os.path.getsize(path)) for kind, path, nbytes in engine.swap_files()]
    out = {
        **base,
        "losses": losses,
        "placement": engine.placement(),
        "files": files,
        "breakdown": engine.memory_breakdown()["measured"],
        "bytes": nbytes,
        # swapped-out masters point at an empty tensor: their sizes come from the swapper
        "masters": getattr(engine.zero.stepper, "numels", []),
        # the swapper's host buffers, with the 4 KiB each over-allocates to align for O_DIRECT
        "buffers": (
            engine.zero.stepper.buffer_bytes() + 4096 * sum(p.count for p in engine.zero.stepper.pools.values())
            if engine.zero.stepper.kind == "nvme"
            else 0
        ),
        "param_numels": [fp.shard_numel for fp in getattr(engine.zero, "flat", []) if hasattr(fp, "shard_numel")],
        "fused": [g.get("fused") for g in engine.optimizer.param_groups],
    }
    engine.destroy()
    out["left"] = [f for _, f, _, _ in files if os.path.exists(f)]
    return out


def _compare_all(cases: dict) -> dict:
    """Every offload case in these ranks (starting processes is the slow part on two cores): per stage
    one run without offload, then each case's offloaded run against it."""
    bases, out = {}, {}
    for name, (stage, opt, param, zero_over) in cases.items():
        if stage not in bases:
            base, base_losses, base_bytes = _train(zero_config(stage))
            shard_numel = sum(m.numel() for g in base.optimizer.param_groups for m in g["params"])
            del base
            gc.collect()
            bases[stage] = {"base": base_losses, "shard_numel": shard_numel, "base_bytes": base_bytes}
        out[name] = _offloaded(bases[stage], stage, opt, param, zero_over)
        gc.collect()
    return out


def _nvme(tmp, **extra):
    return {"device": "nvme", "nvme_path": str(tmp), **extra}


def _cases(tmp: Path) -> dict:
    """name -> (stage, offload_optimizer, offload_param, other zero_optimization keys); NVMe in `tmp`/name."""
    return {
        "cpu_1": (1, {"device": "cpu", "pin_memory": True}, None, {}),
        "cpu_2": (2, {"device": "cpu", "pin_memory": True}, None, {}),
        "cpu_3_params": (3, {"device": "cpu"}, {"device": "cpu", "pin_memory": True}, {}),
        "nvme_3": (3, _nvme(tmp / "nvme_3"), None, {}),
        "nvme_3_params": (
            3,
            _nvme(tmp / "nvme_3_params", pipeline_read=True, pipeline_write=True),
            _nvme(tmp / "nvme_3_params", buffer_count=2, buffer_size=4096),
            {},
        ),
        "nvme_2_pipelined": (2, _nvme(tmp / "nvme_2_pipelined", pipeline_read=True, pipeline_write=True), None, {}),
        "cpu_3_ratio": (3, {"device": "cpu", "ratio": 0.5}, None, {}),
    }


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    """name -> (the case's NVMe folder, per-rank results), all cases in one spawn."""
    tmp = tmp_path_factory.mktemp("offload")
    cases = _cases(tmp)
    for name in cases:
        (tmp / name).mkdir()
    per_rank = run_distributed(_compare_all, 2, cases, timeout=280)
    return {name: (tmp / name, [rank[name] for rank in per_rank]) for name in cases}


def _run(offload_runs, name):
    folder, results = offload_runs[name]
    for r in results:
        diffs = [abs(a - b) for a, b in zip(r["losses"], r["base"])]
        assert len(diffs) == STEPS and max(diffs) <= 1e-5, diffs
        assert r["losses"][-1] < r["losses"][0] - 0.05  # it trains
        assert r["left"] == []  # swap files removed by engine.destroy()
    return folder, results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_optimizer_offload_matches_no_offload(stage, offload_runs):
    for r in _run(offload_runs, f"cpu_{stage}")[1]:
        assert r["placement"]["master_weights"] == "cpu" and r["placement"]["optimizer_states"] == "cpu"
        assert r["placement"]["gradients"] == "cpu"
        assert r["fused"] == [True, True]  # the offloaded step runs torch's fused CPU Adam
        assert r["files"] == []


@pytest.mark.timeout(300)
def test_stage3_cpu_optimizer_and_parameter_offload_matches_no_offload(offload_runs):
    for r in _run(offload_runs, "cpu_3_params")[1]:
        assert r["placement"] == {
            "parameters": "cpu",
            "gradients": "cpu",
            "master_weights": "cpu",
            "optimizer_states": "cpu",
        }


def _check_optimizer_files(r, tmp):
    """One swap file per kind (fp32 masters, Adam's two moments), each exactly its slots' bytes."""
    expected = sum(slot_nbytes(n, torch.float32) for n in r["masters"])
    kinds = {}
    for kind, path, nbytes, on_disk in r["files"]:
        assert Path(path).parent == Path(tmp).resolve()
        assert nbytes == on_disk
        kinds[kind] = on_disk
    assert {k: kinds[k] for k in ("fp32", "exp_avg", "exp_avg_sq")} == {
        k: expected for k in ("fp32", "exp_avg", "exp_avg_sq")
    }
    assert r["breakdown"]["master_weights"] == 0 and r["breakdown"]["optimizer_states"] == 0
    # The census: masters (fp32, aliased with the shard without offload: 0 extra bytes) and the two
    # moments left memory; the swapper's fixed buffers came in. Small slack for scalar step tensors.
    freed = r["base_bytes"] - r["bytes"]
    expect = 8 * r["shard_numel"] - r["buffers"]
    assert abs(freed - expect) <= 256, (freed, expect)


@pytest.mark.timeout(300)
def test_stage3_nvme_optimizer_offload_matches_no_offload(offload_runs):
    folder, results = _run(offload_runs, "nvme_3")
    for r in results:
        assert r["placement"]["optimizer_states"] == f"nvme:{folder.resolve()}"
        assert r["placement"]["parameters"] == "cpu"
        _check_optimizer_files(r, folder)


@pytest.mark.timeout(300)
def test_stage3_nvme_optimizer_and_parameter_offload_matches_no_offload(offload_runs):
    folder, results = _run(offload_runs, "nvme_3_params")
    for r in results:
        assert r["placement"]["parameters"] == f"nvme:{folder.resolve()}"
        params = [f for f in r["files"] if f[0] == "parameters"]
        assert len(params) == 1 and params[0][3] == sum(slot_nbytes(n, torch.float32) for n in r["param_numels"])


@pytest.mark.timeout(300)
def test_stage2_nvme_optimizer_offload_with_pipelined_swaps(offload_runs):
    folder, results = _run(offload_runs, "nvme_2_pipelined")
    for r in results:
        _check_optimizer_files(r, folder)


@pytest.mark.timeout(300)
def test_stage3_partial_cpu_offload_ratio(offload_runs):
    for r in _run(offload_runs, "cpu_3_ratio")[1]:
        assert r["fused"] == [True, True]


def _resume(stage, opt, tmp):
    """Save after 3 steps, go on for 3; a fresh engine loaded from the save must continue identically —
    with offload, and also without it (the checkpoint layout does not depend on where state lived)."""
    cfg = _offload(stage, opt)
    first, _, _ = _train(cfg, steps=3)
    first.save_checkpoint(str(tmp / "ckpt"), tag="t3")
    out = {}
    rank, world = comm.get_rank(), comm.get_world_size()

    def cont(engine):
        losses = []
        for batch in global_batches(world, 6)[3:]:
            for x, y in split_global_batch(batch, world, GAS, rank):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        return losses

    out["straight"] = cont(first)
    first.destroy()
    for name, config in [("offload", cfg), ("plain", zero_config(stage))]:
        model = build_model()
        engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
        engine.load_checkpoint(str(tmp / "ckpt"), tag="t3")
        out[name] = cont(engine)
        engine.destroy()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offloaded_checkpoint_resumes_exactly(stage, tmp_path):
    for r in run_distributed(_resume, 2, stage, _nvme(tmp_path), tmp_path, timeout=250):
        assert r["offload"] == r["straight"] and r["plain"] == pytest.approx(r["straight"], abs=1e-6)


def _mixed(opt):
    base = _train(zero_config(3, bf16={"enabled": True}))[1]
    off = _train(_offload(3, opt, {"device": "cpu"}, **{}) | {"bf16": {"enabled": True}})[1]
    return base, off


@pytest.mark.timeout(300)
def test_bf16_with_cpu_offload_matches_bf16_without():
    for base, off in run_distributed(_mixed, 2, {"device": "cpu"}, timeout=250):
        assert max(abs(a - b) for a, b in zip(base, off)) <= 1e-5


def _max_reductions_in_flight(stage):
    """Train 2 steps with many tiny buckets; count reduce-scatters issued but not yet waited on."""
    from zerospeed.comm import backend

    live, peak = [0], [0]
    issue = backend.reduce_scatter_tensor

    def counting(*args, **kwargs):
        handle = issue(*args, **kwargs)
        if handle is None or not kwargs.get("async_op"):
            return handle
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        wait = handle.wait

        def counted_wait():
            if handle._work is not None:
                live[0] -= 1
            wait()

        handle.wait = counted_wait
        return handle

    comm.reduce_scatter_tensor = counting
    try:
        cfg = zero_config(stage)
        cfg["zero_optimization"]["reduce_bucket_size"] = 500  # dozens of buckets per backward
        engine, losses, _ = _train(cfg, steps=2)
        buckets = len(engine.zero.units)  # gradient units (flat layouts; stage 3: one per module)
    finally:
        comm.reduce_scatter_tensor = issue
    return peak[0], buckets


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_staging_is_bounded_whatever_the_model_size(stage):
    """Note [bounded in-flight buckets]: with overlap_comm, at most 2 reductions (and so a constant
    number of reduce_bucket_size staging buffers) are outstanding, though there are dozens of buckets."""
    for peak, buckets in run_distributed(_max_reductions_in_flight, 2, stage, timeout=180):
        assert buckets >= 10 and 1 <= peak <= 3, (peak, buckets)


def _staging_held_in_flight():
    """Stage 3 fuses several units into one reduce-scatter: once their gradients are copied into the
    bucket's send buffer, no unit may keep its own staging buffer while the collective runs."""
    held, fused = [0], [0]
    cfg = zero_config(3)
    cfg["zero_optimization"]["reduce_bucket_size"] = 3000  # several small units per bucket
    model = build_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    reducer = engine.zero.reducer
    flush = reducer._flush

    def watched_flush():
        flush()
        for flight in reducer._in_flight:
            if len(flight.units) > 1:
                fused[0] += 1
                held[0] = max(held[0], sum(u.staging is not None for u in flight.units))

    reducer._flush = watched_flush
    rank, world = comm.get_rank(), comm.get_world_size()
    for batch in global_batches(world, steps=2):
        for x, y in split_global_batch(batch, world, GAS, rank):
            engine.backward(engine(x, y))
            engine.step()
    return held[0], fused[0]


@pytest.mark.timeout(200)
def test_fused_stage3_buckets_free_each_units_staging_at_launch():
    for held, fused in run_distributed(_staging_held_in_flight, 2, timeout=180):
        assert fused > 0 and held == 0, (held, fused)


def _too_small_buffer(tmp):
    from zerospeed.config import ConfigError

    try:
        _train(_offload(3, None, _nvme(tmp, buffer_size=100)), steps=1)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_nvme_parameter_buffer_smaller_than_a_shard_is_a_clear_error(tmp_path):
    (msg,) = run_distributed(_too_small_buffer, 1, tmp_path, timeout=100)
    assert msg.startswith("zero_optimization.offload_param.buffer_size=100 is too small for the largest parameter")
    assert "set buffer_size to at least 8192" in msg  # the 256 x 31 embedding, whole on 1 rank: 7936 -> 8192
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def _count_read_ahead(tmp):
    """Train with NVMe parameters and prefetch; count gathers whose shard reads were issued one fetch
    ahead and whose collectives were launched later by the next fetch (Note [NVMe reads ahead ...])."""
    from zerospeed.offload.param_swap import NvmeParamSwapper

    ahead = [0]
    real = NvmeParamSwapper.launch_through

    def counting(self, batch=None):
        if batch is None:
            ahead[0] += len(self.unlaunched)
        return real(self, batch)

    NvmeParamSwapper.launch_through = counting
    try:
        _, losses, _ = _train(_offload(3, None, _nvme(tmp)), steps=3)
    finally:
        NvmeParamSwapper.launch_through = real
    return ahead[0], losses


@pytest.mark.timeout(120)
def test_prefetched_nvme_parameter_reads_run_ahead_of_their_gather(tmp_path):
    results = run_distributed(_count_read_ahead, 2, tmp_path, timeout=100)
    assert results[0][0] > 0 and results[0][0] == results[1][0]  # same deferred launches on both ranks
    assert results[0][1] == results[1][1]
