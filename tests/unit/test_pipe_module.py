"""PipelineModule and PipelineEngine in one process (one stage): layers, errors, parity, checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from harness import reference_train
from zerospeed.parallel.pipeline import PipelineError
from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.utils.errors import ConfigError
from zoo.gpt_layers import gpt_layer_specs, lm_loss
from zoo.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=1, n_embd=8)
TRAIN = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
}


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(steps=3):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(steps)
    ]


def test_one_stage_module_computes_the_same_logits_as_the_gpt():
    source = gpt()
    module = PipelineModule(gpt_layer_specs(CFG, source), num_stages=1, loss_fn=lm_loss)
    x = batches(1)[0][0]
    torch.testing.assert_close(module(x), source(x), atol=0, rtol=0)
    assert module.bounds == [0, CFG.n_layer + 4] and module.local_layer_indices() == list(range(6))
    # the two TiedLayerSpecs share one module
    assert list(module.tied_modules) == ["embed"] and "0" not in module.layer_modules


def test_one_stage_engine_matches_plain_training():
    source = gpt()
    module = PipelineModule(gpt_layer_specs(CFG, source), num_stages=1, loss_fn=lm_loss)
    engine, *_ = zerospeed.initialize(model=module, config=TRAIN)
    assert engine.is_first_stage() and engine.is_last_stage()
    got = [engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])])).item() for x, y in batches()]
    ref_model = gpt()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    ref = reference_train(ref_model, opt, batches(), world_size=1, grad_accum=2)
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-6
    x, y = batches()[0]
    loss, logits = engine.eval_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])]), return_logits=True)
    assert logits.shape == (4, 8, 32)
    assert abs(loss.item() - ref_model(x, y).item()) <= 1e-5


def test_activation_checkpointing_keeps_the_losses_and_saves_less():
    def run(interval):
        module = PipelineModule(
            gpt_layer_specs(CFG, gpt()), num_stages=1, loss_fn=lm_loss, activation_checkpoint_interval=interval
        )
        engine, *_ = zerospeed.initialize(model=module, config=TRAIN)
        losses = [engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])])).item() for x, y in batches(2)]
        return losses, engine.activation_stats["peak_bytes"]

    plain, plain_bytes = run(0)
    ckpt, ckpt_bytes = run(2)
    assert max(abs(a - b) for a, b in zip(plain, ckpt)) <= 1e-6
    assert 0 < ckpt_bytes < plain_bytes


def test_seed_layers_builds_reproducible_layers():
    specs = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)]
    a = PipelineModule(specs, num_stages=1, seed_layers=True, base_seed=7)
    torch.manual_seed(123)
    b = PipelineModule(specs, num_stages=1, seed_layers=True, base_seed=7)
    torch.testing.assert_close(a.layer_modules["1"].weight, b.layer_modules["1"].weight, atol=0, rtol=0)
    torch.manual_seed(7 + 1)
    torch.testing.assert_close(a.layer_modules["1"].weight, nn.Linear(4, 4).weight, atol=0, rtol=0)


def test_plain_modules_and_functions_are_layers():
    lin = nn.Linear(3, 3)
    module = PipelineModule([lin, torch.relu, LayerSpec(nn.Linear, 3, 1)], num_stages=1, partition_method="uniform")
    x = torch.randn(2, 3)
    torch.testing.assert_close(module(x), module.layer_modules["2"](torch.relu(lin(x))))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_stages=2), "num_stages=2: world size 1 is not divisible"),
        (dict(), "give num_stages or topology"),
        (dict(num_stages=1, chunks=2), "chunks=2: interleaving needs"),
        (dict(num_stages=1, activation_checkpoint_interval=-1), "activation_checkpoint_interval must be >= 0"),
        (dict(topology=zerospeed.comm.RankGrid(pp=2)), "topology (2, 1, 1, 1) has 2 ranks but the job has 1"),
        (dict(num_stages=1, partition_method="type:Conv"), "'type:Conv': 0 layer(s) match"),
    ],
)
def test_module_errors(kwargs, message):
    with pytest.raises(ConfigError) as err:
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], **kwargs)
    assert message in str(err.value)


def test_spec_and_engine_misuse_errors():
    with pytest.raises(TypeError) as err:
        LayerSpec(torch.relu)
    assert "LayerSpec needs an nn.Module class" in str(err.value)
    with pytest.raises(ConfigError) as err:
        PipelineModule([], num_stages=1)
    assert "`layers` is empty" in str(err.value)
    module = PipelineModule(
        [TiedLayerSpec("w", nn.Linear, 2, 2)], num_stages=1, loss_fn=lambda out, y: (out - y).pow(2).mean()
    )
    with pytest.raises(ConfigError) as err:
        zerospeed.initialize(model=module, config={**TRAIN, "zero_optimization": {"stage": 3}})
    assert "zero_optimization.stage=3 cannot be combined with pipeline parallelism" in str(err.value)
    engine, *_ = zerospeed.initialize(model=module, config=TRAIN)
    with pytest.raises(PipelineError) as err:
        engine(torch.zeros(1, 2))
    assert "use engine.train_batch(data_iter)" in str(err.value)
    with pytest.raises(PipelineError) as err:
        engine.train_batch(iter([torch.zeros(2, 2)] * 2))
    assert "pipeline data must yield (inputs, labels) pairs" in str(err.value)
    with pytest.raises(PipelineError) as err:
        engine.train_batch()
    assert "no data_iter and no training_data" in str(err.value)
