"""Tensor parallelism inside pipeline stages (3D parallelism) and pipelines with ZeRO-2, against the same
GPT trained in one plain PyTorch process (fp32, |dloss| <= 1e-5, final gathered weights allclose).

The layers are `gpt_layer_specs(..., tp_group=...)`: Megatron's split of the test GPT (fused qkv and
the MLP's first layer by columns, attention output and the MLP's second layer by rows, the tied
embedding / output head by vocabulary, vocab-parallel cross-entropy), built from the reference
model's weights. Cases run one after another in the same processes (spawning is the slow part).
"""

from __future__ import annotations

import gc

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from harness.census import live_tensor_bytes
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.parallel.pipeline.topology import PipeModelDataParallelTopology
from zerospeed.parallel.tensor import gather_full, param_layouts
from zerospeed.pipe import PipelineModule
from zoo.data import text_batches
from zoo.gpt_layers import TensorParallelLoss, gpt_layer_specs, lm_loss
from zoo.models import GPT, GPTConfig

MICRO, GAS, SEQ, LR = 2, 4, 8, 3e-3
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=16, bias=True)


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def global_batches(dp: int, steps: int):
    n = dp * GAS * MICRO
    return text_batches(steps, n, SEQ)


def train(pp: int, tp: int, stage: int, steps: int, deepspeed_topology: bool = False) -> dict:
    """One pipeline engine over the whole world: pp stages x tp ranks x (the rest) data parallel.
    `deepspeed_topology`: the module gets DeepSpeed's PipeModelDataParallelTopology (the layers the tp
    group of a mesh made from it)."""
    gc.collect()
    before = live_tensor_bytes()
    mesh = ParallelMesh.build(pp=pp, tp=tp)
    topology = mesh
    if deepspeed_topology:
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=comm.get_world_size() // (pp * tp))
        mesh = ParallelMesh.from_grid(topology.to_grid())
    group = mesh.group("tp") if tp > 1 else None
    module = PipelineModule(
        gpt_layer_specs(MODEL, build_gpt(), tp_group=group),
        topology=topology,
        loss_fn=TensorParallelLoss(group, MODEL.vocab_size) if group else lm_loss,
    )
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerospeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    dp, dp_rank = mesh.size("dp"), mesh.rank_in("dp")
    losses, norms = [], []
    for b in global_batches(dp, steps):
        losses.append(engine.train_batch(iter(split_global_batch(b, dp, GAS, dp_rank))).item())
        norms.append(engine.get_global_grad_norm())
    tied = None
    if "embed" in engine.module.tied_modules:
        emb = engine.module.tied_modules["embed"]
        if group is None:
            tied = emb.weight.detach().clone()
        else:
            tied = gather_full(emb.embed.weight, param_layouts(emb)["embed.weight"], group)
    gc.collect()
    return {
        "losses": losses,
        "tied": tied,
        "norm": norms[0],
        "engine_bytes": live_tensor_bytes() - before,
        "stage_params": sum(p.numel() for p in module.parameters()),
    }


def run_cases(cases):
    return [train(*case) for case in cases]


def first_grad_norm(dp: int) -> float:
    """The full model's gradient norm on the first batch (each weight counted once: the tied one too)."""
    model = build_gpt()
    batch = global_batches(dp, 1)[0]
    for rank in range(dp):
        for micro in split_global_batch(batch, dp, GAS, rank):
            (model(*micro) / (dp * GAS)).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def reference(dp: int, steps: int) -> dict:
    model = build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = reference_train(model, opt, global_batches(dp, steps), world_size=dp, grad_accum=GAS, clip=1.0)
    return {"losses": losses, "wte": model.wte.weight.detach(), "norm": first_grad_norm(dp)}


def check(results: list[dict], dp: int, steps: int, trains: bool = True) -> None:
    ref = reference(dp, steps)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5, (r["losses"], ref["losses"])
        assert abs(r["norm"] - ref["norm"]) <= 1e-5 * ref["norm"], (r["norm"], ref["norm"])
        if r["tied"] is not None:
            torch.testing.assert_close(r["tied"], ref["wte"], atol=1e-5, rtol=0)
    if trains:
        assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it really trains
    assert ref["norm"] > 1.0  # so clipping at 1.0 acts: the losses depend on the norm being right


CASES = [
    (2, 2, 0, 6),
    (2, 2, 1, 3),
    (2, 1, 2, 3),
    (2, 2, 2, 3),
    (2, 1, 1, 3),  # (pp, tp, zero stage, steps)
    (2, 2, 1, 3, True),
]  # DeepSpeed's PipeModelDataParallelTopology(2, 2, 1)


def four_rank_work(path: str) -> dict:
    """Every 4-process case in one spawn (processes are the expensive part on two cores)."""
    return {"cases": run_cases(CASES), "legs": reshard_legs(path)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe_tp_ckpt")
    return run_distributed(four_rank_work, 4, str(path), timeout=280), path


@pytest.mark.timeout(300)
def test_pipeline_by_tensor_parallel_two_by_two_matches_single_process(four_ranks):
    """pp x tp = 2 x 2 at ZeRO-0 and ZeRO-1: losses, the gradient norm (clipping acts) and the gathered
    tied embedding equal the single process's."""
    per_rank, _ = four_ranks
    for i in (0, 1, 5):
        pp, tp, stage, steps = CASES[i][:4]
        check([rank["cases"][i] for rank in per_rank], 4 // (pp * tp), steps, trains=i == 0)


@pytest.mark.timeout(300)
def test_pipeline_with_zero2_matches_single_process(four_ranks):
    """pp x dp = 2 x 2 with ZeRO-2 (which DeepSpeed refuses) and pp x tp = 2 x 2 at ZeRO-2; by census,
    ZeRO-2 holds half the stage's fp32 gradient that ZeRO-1 holds (dp = 2)."""
    per_rank, _ = four_ranks
    for i in (2, 3):
        pp, tp, stage, steps = CASES[i]
        check([rank["cases"][i] for rank in per_rank], 4 // (pp * tp), steps, trains=False)
    for rank in per_rank:
        zero2, zero1 = rank["cases"][2], rank["cases"][4]
        saved = zero1["engine_bytes"] - zero2["engine_bytes"]
        half = zero1["stage_params"] * 4 / 2
        assert half <= saved <= half * 1.01, (saved, half)  # (flat buffers pad to a multiple of dp)


@pytest.mark.timeout(300)
def test_three_d_dp_pp_tp_two_by_two_by_two_matches_single_process():
    """8 processes: 2 stages x 2 tensor-parallel x 2 data-parallel, ZeRO-1."""
    per_rank = run_distributed(run_cases, 8, [(2, 2, 1, 2)], timeout=280)
    check([rank[0] for rank in per_rank], 2, 2, trains=False)


GLOBAL = 8  # samples per step, whatever the layout (gradient accumulation = GLOBAL / (MICRO * dp))


def fixed_batches(steps: int):
    return text_batches(steps, GLOBAL, SEQ)


def checkpoint_leg(pp: int, tp: int, stage: int, path: str, steps: range, save: bool) -> list[float]:
    """Train `steps` of the fixed batches at (pp, tp, dp = rest); save after them, or load before."""
    mesh = ParallelMesh.build(pp=pp, tp=tp)
    group, dp = mesh.group("tp"), mesh.size("dp")
    module = PipelineModule(
        gpt_layer_specs(MODEL, build_gpt(), tp_group=group),
        topology=mesh,
        loss_fn=TensorParallelLoss(group, MODEL.vocab_size),
    )
    gas = GLOBAL // (MICRO * dp)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerospeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    if not save:
        engine.load_checkpoint(path)
    batches = fixed_batches(steps.stop)
    losses = [
        engine.train_batch(iter(split_global_batch(batches[s], dp, gas, mesh.rank_in("dp")))).item() for s in steps
    ]
    if save:
        engine.save_checkpoint(path, tag="mid")
    return losses


def reshard_legs(path: str) -> list[list[float]]:
    legs = [
        (2, 2, 0, True),
        (4, 1, 0, False),
        (1, 2, 0, False),
        (2, 1, 0, False),
        (2, 2, 1, True),
        (2, 2, 1, False),
    ]  # ZeRO-1: per-rank flat files, the same layout only
    return [
        checkpoint_leg(pp, tp, stage, path + ("/zero1" if stage else ""), range(0, 3) if save else range(3, 6), save)
        for pp, tp, stage, save in legs
    ]


@pytest.mark.timeout(300)
def test_pipeline_tensor_parallel_checkpoint_loads_at_other_pp_tp_dp(four_ranks):
    """Saved at (pp 2, tp 2, dp 1), resumed at (pp 4, tp 1), (pp 1, tp 2, dp 2) and (pp 2, tp 1, dp 2):
    the next three losses are the uninterrupted single-process run's (weights, fp32 masters and Adam
    states all restored from full-layout layer files); ZeRO-1 resumes in its own layout."""
    per_rank, path = four_ranks
    model = build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref = reference_train(model, opt, fixed_batches(6), world_size=1, grad_accum=GLOBAL // MICRO, clip=1.0)
    for rank in per_rank:
        for leg, expected in zip(rank["legs"], [ref[:3], ref[3:], ref[3:], ref[3:], ref[:3], ref[3:]], strict=True):
            assert max(abs(a - b) for a, b in zip(leg, expected)) <= 1e-5, (leg, expected)
    assert sorted(p.name for p in (path / "mid").iterdir() if "optim" in p.name)[0] == "layer_00-optim_states.pt"
    assert (path / "zero1" / "mid" / "zero_pp_rank_1_dp_rank_0_mp_rank_01_optim_states.pt").exists()
