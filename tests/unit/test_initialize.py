"""zerospeed.initialize in one process: API mis-use errors, argument parsing, a one-rank parity run."""

import argparse
import json

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError
from zoo.models import TinyMLP

CFG = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_model_is_required():
    with pytest.raises(ConfigError, match="`model` is required"):
        zerospeed.initialize(config=CFG)


def test_no_config_is_an_error():
    with pytest.raises(ConfigError, match="no config"):
        zerospeed.initialize(model=TinyMLP())


def test_config_given_twice_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CFG))
    args = argparse.Namespace(deepspeed=True, deepspeed_config=str(path))
    with pytest.raises(ConfigError, match="given twice"):
        zerospeed.initialize(args=args, model=TinyMLP(), config=CFG)


def test_max_grad_norm_in_optimizer_params_points_to_gradient_clipping():
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}
    with pytest.raises(ConfigError, match="gradient_clipping"):
        zerospeed.initialize(model=TinyMLP(), config=cfg)


def test_fp16_and_bf16_together_is_an_error():
    cfg = dict(CFG, fp16={"enabled": True}, bf16={"enabled": True})
    with pytest.raises(ConfigError, match="bf16"):
        zerospeed.initialize(model=TinyMLP(), config=cfg)


def test_add_config_arguments_accepts_both_spellings(tmp_path):
    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed", "a.json"]).deepspeed == "a.json"
    flagged = parser.parse_args(["--deepspeed", "--deepspeed_config", "b.json"])
    assert flagged.deepspeed is True and flagged.deepspeed_config == "b.json"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CFG))
    engine, *_ = zerospeed.initialize(args=parser.parse_args(["--deepspeed", str(path)]), model=TinyMLP())
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 1


def test_one_rank_engine_matches_plain_pytorch():
    torch.manual_seed(0)
    ref, model = TinyMLP(), TinyMLP()
    model.load_state_dict(ref.state_dict())
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    engine, optimizer, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batches = [(torch.randn(2, 16, generator=gen), torch.randn(2, 8, generator=gen)) for _ in range(3)]
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        opt.zero_grad()
        for x, y in batches:
            (ref(x, y) / 3).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert engine.global_steps == 4 and engine.micro_steps == 12 and engine.global_samples == 24
    assert engine.get_global_grad_norm() > 0 and engine.was_step_applied()
    assert engine.get_lr() == [1e-2] and optimizer is engine.optimizer


def test_monitors_timers_and_progress_line_are_wired_through_the_config(tmp_path, caplog):
    import csv
    import logging

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
    }
    engine, *_ = zerospeed.initialize(model=TinyMLP(), config=cfg)
    losses = []
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            x, y = torch.randn(2, 16), torch.randn(2, 8)
            loss = engine(x, y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
    engine.destroy()
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert "Train_Samples_train_loss.csv" in files and "Train_Samples_lr.csv" in files
    rows = list(csv.reader(open(tmp_path / "run" / "Train_Samples_train_loss.csv")))
    assert rows[0] == ["step", "Train/Samples/train_loss"] and len(rows) == 3  # two optimizer steps
    assert abs(float(rows[1][1]) - (losses[0] + losses[1]) / 2) < 1e-6
    assert "forward" in caplog.text and "backward" in caplog.text  # the wall-clock breakdown


def test_deprecated_deepscale_config_is_read_as_deepspeed_config(tmp_path):
    # DeepSpeed 0.19.8 (deepspeed/__init__.py, initialize): a set args.deepscale_config is moved to
    # args.deepspeed_config with a warning; both set is an error.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(CFG, train_batch_size=8)))
    args = zerospeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", str(path)])
    engine, *_ = zerospeed.initialize(args=args, model=TinyMLP())
    assert engine.train_batch_size() == 8
    assert (args.deepspeed_config, args.deepscale_config) == (str(path), None)
    both = argparse.Namespace(deepscale_config=str(path), deepspeed_config=str(path))
    with pytest.raises(ConfigError, match="keep --deepspeed_config"):
        zerospeed.initialize(args=both, model=TinyMLP())
