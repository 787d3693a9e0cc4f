"""Pipeline training against the same GPT trained in one plain PyTorch process (fp32, |dloss| <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.pipe import PipelineModule
from zoo.data import text_batches
from zoo.gpt_layers import gpt_layer_specs, lm_loss
from zoo.models import GPT, GPTConfig

MICRO, STEPS, SEQ, LR = 2, 5, 8, 3e-3  # 5 steps: the loss already falls by 0.26
MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=1, n_embd=16, bias=True)


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def global_batches(dp: int, gas: int, steps: int = STEPS):
    n = dp * gas * MICRO
    return text_batches(steps, n, SEQ)


def config(gas: int, stage: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }


def micro_batches(engine, batch, gas):
    dp = comm.get_world_size(engine.dp_group)
    return iter(split_global_batch(batch, dp, gas, comm.get_rank(engine.dp_group)))


def build_engine(
    pp: int,
    gas: int,
    chunks: int = 1,
    stage: int = 0,
    partition: str = "parameters",
    schedule: str = "1f1b",
    precision: str = "fp32",
):
    module = PipelineModule(
        gpt_layer_specs(MODEL, build_gpt()), num_stages=pp, loss_fn=lm_loss, partition_method=partition, chunks=chunks
    )
    cfg = config(gas, stage)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    engine.train_schedule = schedule
    return engine


def train_pipe(
    pp: int,
    gas: int,
    chunks: int = 1,
    stage: int = 0,
    schedule: str = "1f1b",
    precision: str = "fp32",
    steps: int = STEPS,
) -> dict:
    engine = build_engine(pp, gas, chunks, stage, schedule=schedule, precision=precision)
    dp = comm.get_world_size(engine.dp_group)
    losses = [engine.train_batch(micro_batches(engine, b, gas)).item() for b in global_batches(dp, gas, steps)]
    eval_loss = engine.eval_batch(micro_batches(engine, global_batches(dp, gas, 1)[0], gas)).item()
    tied = (
        engine.module.tied_modules["embed"].weight.detach().clone() if "embed" in engine.module.tied_modules else None
    )
    return {
        "losses": losses,
        "eval": eval_loss,
        "stage": engine.stage_id,
        "tied": tied,
        "peak": engine.activation_stats["peak_micro_batches"],
    }


def run_cases(cases: list[tuple]) -> list[dict]:
    """Several pipelines, one after the other, in the same processes (spawning is the slow part)."""
    return [train_pipe(*case) for case in cases]


def reference(dp: int, gas: int, steps: int = STEPS) -> dict:
    model = build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = reference_train(model, opt, global_batches(dp, gas, steps), world_size=dp, grad_accum=gas, clip=1.0)
    with torch.no_grad():
        x, y = global_batches(dp, gas, 1)[0]
        eval_loss = model(x, y).item()
    return {"losses": losses, "eval": eval_loss, "wte": model.wte.weight.detach()}


def check(results: list[dict], dp: int, gas: int) -> None:
    ref = reference(dp, gas)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5, (r["losses"], ref["losses"])
        assert abs(r["eval"] - ref["eval"]) <= 1e-5
        if r["tied"] is not None:  # the embedding (stage 0) and the head (last stage) stay one weight
            torch.testing.assert_close(r["tied"], ref["wte"], atol=1e-5, rtol=0)
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it really trains


@pytest.mark.timeout(150)
def test_two_stages_and_interleaved_match_single_process():
    # (pp, gas, chunks, zero stage, schedule): 1F1B with 4 and 8 micro-batches; 2 virtual stages per
    # rank; GPipe fill-drain
    cases = [(2, 4, 1, 0, "1f1b"), (2, 8, 1, 0, "1f1b"), (2, 4, 2, 0, "1f1b"), (2, 4, 1, 0, "fill_drain")]
    per_rank = run_distributed(run_cases, 2, cases + [(2, 4, 1, 1, "1f1b", "bf16")])
    # bf16 with ZeRO-1: fp32 masters, 16-bit activations and gradients between stages — close, not equal
    bf16_ref = reference(1, 4)["losses"]
    for rank in per_rank:
        assert max(abs(a - b) for a, b in zip(rank[-1]["losses"], bf16_ref)) < 0.05
    for i, (_pp, gas, chunks, _, schedule) in enumerate(cases):
        results = [rank[i] for rank in per_rank]
        check(results, 1, gas)
        if schedule == "fill_drain":  # every micro-batch alive at once on every stage
            assert [r["peak"] for r in results] == [4, 4]
        elif chunks == 1:  # 1F1B keeps at most (stages - stage) micro-batches alive
            assert [r["peak"] for r in results] == [2, 1]
        else:  # interleaved: warm-up (p - s - 1) * 2 + (chunks - 1) * p, plus the one in flight
            assert [r["peak"] for r in results] == [(2 - 0 - 1) * 2 + 2 + 1, (2 - 1 - 1) * 2 + 2 + 1]


@pytest.mark.timeout(150)
def test_four_stages_and_two_by_two_data_parallel_match_single_process():
    cases = [(4, 4, 1, 0), (4, 8, 1, 0), (2, 4, 1, 1)]  # the last: 2 stages x 2 data-parallel, ZeRO-1
    per_rank = run_distributed(run_cases, 4, cases)
    for i, (pp, gas, _chunks, _) in enumerate(cases):
        results = [rank[i] for rank in per_rank]
        check(results, 4 // pp, gas)
        if pp == 4:
            assert [r["peak"] for r in results] == [4, 3, 2, 1]
        else:
            assert [r["stage"] for r in results] == [0, 0, 1, 1]
