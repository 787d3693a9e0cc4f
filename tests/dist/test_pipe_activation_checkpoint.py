"""Pipeline activation checkpointing from the config's `pipeline` block: the same losses as the pipeline
without it and as one plain PyTorch process (fp32, |dloss| <= 1e-5), with fewer saved activation bytes."""

from __future__ import annotations

import logging

import pytest
import torch

import zerospeed
from harness import reference_train, run_distributed, split_global_batch
from zerospeed import comm
from zerospeed.pipe import PipelineModule
from zoo.data import text_batches
from zoo.gpt_layers import gpt_layer_specs, lm_loss
from zoo.models import GPT, GPTConfig

MICRO, GAS, STEPS, SEQ, LR = 2, 4, 4, 8, 3e-3
MODEL = GPTConfig(vocab_size=128, block_size=SEQ, n_layer=4, n_head=1, n_embd=16, bias=True)


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def batches(steps: int = STEPS):
    return text_batches(steps, GAS * MICRO, SEQ)


def train(pipeline: dict, pp: int = 2) -> dict:
    module = PipelineModule(gpt_layer_specs(MODEL, build_gpt()), num_stages=pp, loss_fn=lm_loss)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "pipeline": pipeline,
    }
    engine, *_ = zerospeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    dp_rank = comm.get_rank(engine.dp_group)
    losses = [engine.train_batch(iter(split_global_batch(b, 1, GAS, dp_rank))).item() for b in batches()]
    return {
        "losses": losses,
        "peak": engine.activation_stats["peak_bytes"],
        "func": engine.module.activation_checkpoint_func.__name__,
        "interval": engine.module.activation_checkpoint_interval,
    }


CASES = [
    {},  # no checkpointing
    {"activation_checkpoint_interval": 1},  # DeepSpeed's default: re-entrant
    {"activation_checkpoint_interval": 2, "use_reentrant": False},
    {"activation_checkpoint_interval": 3, "use_reentrant": True, "stages": 2, "partition": "parameters"},
]


def run_cases() -> list[dict]:
    return [train(case) for case in CASES]


def reference() -> list[float]:
    model = build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return reference_train(model, opt, batches(), world_size=1, grad_accum=GAS, clip=1.0)


@pytest.mark.timeout(120)
def test_pipeline_activation_checkpointing_matches_the_pipeline_without_it():
    per_rank = run_distributed(run_cases, 2)
    ref = reference()
    assert ref[-1] < ref[0] - 0.05  # it trains
    for rank in per_rank:
        plain = rank[0]
        assert plain["interval"] == 0
        for case, got in zip(CASES, rank):
            assert max(abs(a - b) for a, b in zip(got["losses"], ref)) <= 1e-5, (case, got["losses"], ref)
            assert max(abs(a - b) for a, b in zip(got["losses"], plain["losses"])) <= 1e-6
        assert [r["interval"] for r in rank] == [0, 1, 2, 3]
        assert [r["func"] for r in rank[1:]] == ["checkpoint", "non_reentrant_checkpoint", "checkpoint"]
        # each stage keeps fewer activation bytes alive than without checkpointing (the re-entrant
        # function holds its blocks' inputs itself, outside the saved-tensor hooks the engine counts)
        for got in rank[1:]:
            assert got["peak"] < plain["peak"], (got["peak"], plain["peak"])
        assert rank[2]["peak"] > 0


def test_pipeline_keys_the_module_decides_are_logged_not_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="zerospeed"):
        got = train({"stages": 2, "partition": "uniform", "seed_layers": True}, pp=1)
    text = caplog.text
    assert "pipeline.stages=2" in text and "num_stages=1" in text
    assert "pipeline.partition='uniform'" in text and "seed_layers" in text
    assert got["interval"] == 0 and len(got["losses"]) == STEPS
