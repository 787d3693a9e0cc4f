"""Monitors and the engine observer: a few real engine steps, then the CSV and TensorBoard files are read back
(the event files by TensorBoard's own reader, `tensorboard.backend.event_processing`)."""

import csv
import logging
import sys

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError, parse_config
from zerospeed.monitor import TensorBoardMonitor, read_scalars
from zerospeed.monitor.plot_cli import main as plot_main
from zerospeed.monitor.writers import CsvMonitor, build_monitors
from zerospeed.profiling.observer import EngineObserver
from zoo.models import GPT, GPTConfig

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}
TAGS = {
    "Train/Samples/train_loss",
    "Train/Samples/lr",
    "Train/Samples/loss_scale",
    "Train/Samples/grad_norm",
    "Train/Samples/samples_per_sec",
    "Train/Samples/tokens_per_sec",
    "Train/Samples/memory_MiB_rank0",
}


def accumulate(path):
    """TensorBoard's own reader over an event file or run directory, keeping every scalar."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return acc


def test_tensorboard_monitor_events_read_back_by_tensorboard(tmp_path):
    mon = TensorBoardMonitor(str(tmp_path), "job")
    mon.write_events([("Train/Samples/train_loss", 2.5, 4), ("Train/Samples/lr", 0.125, 4)])
    mon.write_events([("Train/Samples/train_loss", 1.75, 8), ("Train/Samples/lr", 0.0625, 8)])
    (event_file,) = (tmp_path / "job").iterdir()  # output_path/job_name, one file of TensorBoard's name
    assert event_file.name.startswith("events.out.tfevents.")
    acc = accumulate(event_file)  # before close: each write_events flushed its step
    assert sorted(acc.Tags()["scalars"]) == ["Train/Samples/lr", "Train/Samples/train_loss"]
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")] == [(4, 2.5), (8, 1.75)]
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/lr")] == [(4, 0.125), (8, 0.0625)]
    mon.close()
    assert read_scalars(tmp_path / "job") == [
        ("Train/Samples/lr", 0.125, 4),
        ("Train/Samples/lr", 0.0625, 8),
        ("Train/Samples/train_loss", 2.5, 4),
        ("Train/Samples/train_loss", 1.75, 8),
    ]
    with pytest.raises(FileNotFoundError, match="no TensorBoard event file or run directory at"):
        read_scalars(tmp_path / "missing")


def test_tensorboard_without_the_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were missing
    cfg = parse_config(dict(BASE, tensorboard={"enabled": True, "output_path": str(tmp_path)}), check_features=False)
    with pytest.raises(
        ConfigError,
        match=r"tensorboard.enabled=true but the `tensorboard` package is not "
        r"installed; `pip install 'zerospeed\[tensorboard\]'`",
    ):
        build_monitors(cfg)


def run_steps(tmp_path, steps=3, **tools):
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=GPT(GPTConfig()), config=BASE)
    cfg = parse_config(dict(BASE, **tools), check_features=False)
    obs = EngineObserver(cfg, rank=0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    losses, norms = [], []
    for _ in range(steps * 2):
        obs.on_forward_start(engine, x, x)
        loss = engine(x, x)
        obs.on_forward_end(engine)
        obs.on_backward_start(engine, loss)
        engine.backward(loss)
        obs.on_backward_end(engine)
        obs.on_step_start(engine)
        engine.step()
        obs.on_step_end(engine)
        losses.append(loss.item())
        if engine.micro_steps % 2 == 0:
            norms.append(engine.get_global_grad_norm())
    obs.close()
    return engine, obs, losses, norms


def test_csv_and_tensorboard_read_back(tmp_path):
    out = str(tmp_path)
    _, _, losses, norms = run_steps(
        tmp_path,
        tensorboard={"enabled": True, "output_path": out, "job_name": "tb"},
        csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"},
    )
    mean_loss = [(losses[2 * i] + losses[2 * i + 1]) / 2 for i in range(3)]
    samples = [4, 8, 12]  # train_batch_size 4 per step; DeepSpeed plots against samples

    with open(tmp_path / "csv" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(mean_loss, rel=1e-12)
    with open(tmp_path / "csv" / "Train_Samples_grad_norm.csv") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == pytest.approx(norms, rel=1e-12)
    assert {p.stem for p in (tmp_path / "csv").glob("*.csv")} == {t.replace("/", "_") for t in TAGS}

    (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    acc = accumulate(event_file)
    assert set(acc.Tags()["scalars"]) == TAGS

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert [s for s, _ in series("Train/Samples/train_loss")] == samples
    assert [v for _, v in series("Train/Samples/train_loss")] == pytest.approx(mean_loss, rel=1e-6)  # float32
    assert [v for _, v in series("Train/Samples/lr")] == pytest.approx([1e-3] * 3)
    assert series("Train/Samples/loss_scale") == [(s, 1.0) for s in samples]
    tokens = [v for _, v in series("Train/Samples/tokens_per_sec")]
    sps = [v for _, v in series("Train/Samples/samples_per_sec")]
    assert all(tok == pytest.approx(s * 16, rel=1e-5) for tok, s in zip(tokens, sps))  # 16 tokens per sample

    assert plot_main([str(tmp_path / "csv")]) == 0
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "csv" / "Train_Samples_train_loss.png").shape == (400, 640, 4)
    # the per-rank memory series (one rank here) share one plot
    assert (tmp_path / "csv" / "Train_Samples_memory_MiB.png").exists()


def test_progress_line_timers_profiler_and_comms(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="zerospeed.profiling.observer")
    run_steps(
        tmp_path,
        steps=2,
        steps_per_print=2,
        wall_clock_breakdown=True,
        memory_breakdown=True,
        comms_logger={"enabled": True},
        flops_profiler={
            "enabled": True,
            "profile_step": 1,
            "detailed": False,
            "output_file": str(tmp_path / "flops.txt"),
        },
    )
    messages = [r.getMessage() for r in caplog.records]
    # DeepSpeed's line (engine._report_progress), then zerospeed's numbers in the same key=value form
    progress = [
        m
        for m in messages
        if m.startswith("[Rank 0] step=2, skipped=0, lr=[0.001], mom=[(0.9, 0.999)], samples=8, loss=")
    ]
    assert len(progress) == 1 and ", grad_norm=" in progress[0] and ", tokens/sec=" in progress[0], messages
    timing = [m for m in messages if m.startswith("step 2 time (ms) | forward: ")]
    assert len(timing) == 1 and "| backward: " in timing[0] and "| comm: " in timing[0]
    assert any(m.startswith("memory: allocated") for m in messages)
    assert any(m.startswith("communication totals:") for m in messages)
    profile = (tmp_path / "flops.txt").read_text()
    assert "profile step:                  1" in profile
    # one forward of micro-batch 2 x 16 tokens plus the loss: GPT logits count + cross-entropy (32 x 256)
    assert "forward FLOPs:                 7.73 MFLOPs" in profile


def test_wall_clock_breakdown_splits_the_boundary_step():
    # the engine's own observer: the step at an accumulation boundary is timed in its parts too
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(
        model=GPT(GPTConfig()), config=dict(BASE, wall_clock_breakdown=True, steps_per_print=10**6)
    )
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(4):  # 2 boundaries (gradient accumulation 2)
        engine.backward(engine(x, x))
        engine.step()
    timers = engine.observer.timers
    parts = ("step.reduce", "step.grad_norm", "step.optimizer")
    assert all(timers.count(p) == 2 for p in parts) and timers.count("step") == 4, timers.names()
    assert sum(timers.elapsed(p) for p in parts) <= timers.elapsed("step")


def test_everything_off_is_inactive_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, obs, _, _ = run_steps(tmp_path, steps=1)
    assert not obs.active and obs.monitors == [] and list(tmp_path.iterdir()) == []


def test_errors_and_rank_gating(tmp_path):
    with pytest.raises(ConfigError, match="comms_logger.debug=true: naming the calling function"):
        EngineObserver(parse_config(dict(BASE, comms_logger={"enabled": True, "debug": True}), check_features=False))
    cfg = parse_config(dict(BASE, csv_monitor={"enabled": True, "output_path": str(tmp_path)}), check_features=False)
    assert EngineObserver(cfg, rank=1).monitors == []  # only rank 0 writes
    assert isinstance(build_monitors(cfg)[0], CsvMonitor)
    for section, module in (("wandb", "wandb"), ("comet", "comet_ml")):
        bad = parse_config(dict(BASE, **{section: {"enabled": True}}), check_features=False)
        with pytest.raises(ConfigError, match=f"{section}.enabled=true but the `{module}` package is not installed"):
            build_monitors(bad)


def test_plot_cli_errors(tmp_path, capsys):
    assert plot_main([str(tmp_path)]) == 2
    assert "no csv_monitor files with data" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    assert plot_main([str(tmp_path)]) == 2
    assert "not a csv_monitor file" in capsys.readouterr().err


def test_plot_cli_draws_one_plot_per_tag_and_one_for_all_ranks(tmp_path, monkeypatch):
    from zerospeed.monitor import plot_cli

    for name, tag, rows in (
        ("Train_Samples_train_loss", "Train/Samples/train_loss", "4,2.5\n8,2.0\n"),
        ("Train_Samples_memory_MiB_rank0", "Train/Samples/memory_MiB_rank0", "4,10\n8,11\n"),
        ("Train_Samples_memory_MiB_rank1", "Train/Samples/memory_MiB_rank1", "4,12\n8,13\n"),
    ):
        (tmp_path / f"{name}.csv").write_text(f"step,{tag}\n{rows}")
    calls = []
    monkeypatch.setattr(plot_cli, "save_line_plot", lambda png, ys, **kw: calls.append((png.name, ys, kw)))
    plot_cli.plot_run(tmp_path)
    assert calls == [
        (
            "Train_Samples_memory_MiB.png",
            {"rank 0": [10.0, 11.0], "rank 1": [12.0, 13.0]},
            {
                "xs": {"rank 0": [4.0, 8.0], "rank 1": [4.0, 8.0]},
                "title": "Train/Samples/memory_MiB per rank",
                "xlabel": "samples",
                "ylabel": "memory MiB",
            },
        ),
        (
            "Train_Samples_train_loss.png",
            [2.5, 2.0],
            {"xs": [4.0, 8.0], "title": "Train/Samples/train_loss", "xlabel": "samples", "ylabel": "train loss"},
        ),
    ]
    monkeypatch.undo()
    assert sorted(p.name for p in plot_cli.plot_run(tmp_path)) == [
        "Train_Samples_memory_MiB.png",
        "Train_Samples_train_loss.png",
    ]
