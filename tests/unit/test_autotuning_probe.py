"""The trial side of the autotuner in one process: the probe (profiling/trial_probe.py, run by the engine's
observer) writes DeepSpeed's metrics at end_profile_step and exits, or the model information after the
first forward pass."""

import json

import pytest
import torch

import zerospeed
from zerospeed.profiling.trial_probe import ENV_METRIC_PATH, ENV_MODEL_INFO_PATH, step_metrics
from zoo.models import TinyMLP

CFG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 3},
}


def train(engine, steps=10):
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(4, 16), torch.randn(4, 8)
        engine.backward(engine(x, y))
        engine.step()


def test_step_metrics_are_deepspeeds():
    m = step_metrics([0.5, 0.25, 0.75], train_batch_size=8, gas=2, forward_flops=100)
    assert m == {"latency": 500.0, "throughput": 16.0, "FLOPS_per_gpu": 100 * 3 * 2 / 0.5}
    with pytest.raises(ValueError):
        step_metrics([], 8, 1, None)


def test_without_the_autotuner_there_is_no_probe(monkeypatch):
    monkeypatch.delenv(ENV_METRIC_PATH, raising=False)
    monkeypatch.delenv(ENV_MODEL_INFO_PATH, raising=False)
    engine, *_ = zerospeed.initialize(model=TinyMLP(), config=CFG)
    assert engine.trial_probe is None
    train(engine, 4)  # the enabled autotuning block does not end a training run
    assert engine.global_steps == 4


def test_metric_run_times_the_profile_steps_then_exits(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    monkeypatch.setenv(ENV_METRIC_PATH, str(path))
    engine, *_ = zerospeed.initialize(model=TinyMLP(), config=CFG)
    with pytest.raises(SystemExit) as exit_:
        train(engine)
    assert exit_.value.code == 0 and engine.global_steps == 3
    m = json.loads(path.read_text())
    assert len(m["step_seconds"]) == 2 and m["steps"] == [2, 3]
    assert m["latency"] == pytest.approx(1e3 * sum(m["step_seconds"]) / 2)
    assert m["throughput"] == pytest.approx(8 / (m["latency"] / 1e3))
    # TinyMLP(16 -> 32 -> 32 -> 8) on 4 samples: 2 x (16x32 + 32x32 + 32x8) MACs each, plus the activations
    assert m["FLOPS_per_gpu"] > 0 and (m["train_batch_size"], m["gradient_accumulation_steps"]) == (8, 2)
    assert not list(tmp_path.glob("*.tmp*"))


def test_model_info_run_counts_parameters_and_saved_activations(tmp_path, monkeypatch):
    path = tmp_path / "model_info.json"
    monkeypatch.setenv(ENV_MODEL_INFO_PATH, str(path))
    model = TinyMLP()
    engine, *_ = zerospeed.initialize(model=model, config=CFG)
    with pytest.raises(SystemExit):
        train(engine)
    info = json.loads(path.read_text())
    assert info["num_params"] == sum(p.numel() for p in model.parameters())
    assert info["largest_layer_params"] == 32 * 32 + 32
    assert (info["param_bytes"], info["grad_bytes"], info["master_bytes"], info["optim_bytes"]) == (4, 4, 0, 8)
    assert (info["micro_batch"], info["dp_world_size"], info["device"]) == (4, 1, "cpu")
    # saved for backward: the input and each layer's outputs, fp32; at least the two hidden ReLU outputs
    assert 2 * 4 * 32 * 4 <= info["activation_bytes"] <= 4 * 4 * (16 + 4 * 32 + 8 + 8)
    assert engine.global_steps == 0  # it stopped inside the first forward pass
