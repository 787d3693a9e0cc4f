"""Monitors and the engine observer: a few real engine steps, then the CSV and TensorBoard files are read back."""
import csv
import logging

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError, parse_config
from zerospeed.monitor import crc32c, read_scalars
from zerospeed.monitor.plot_cli import main as plot_main
from zerospeed.monitor.tfevents import encode_scalar_event, masked_crc, read_records, record
from zerospeed.monitor.writers import CsvMonitor, build_monitors
from zerospeed.profiling.observer import EngineObserver
from zerospeed.testing.models import GPT, GPTConfig

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
TAGS = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale", "Train/Samples/grad_norm",
        "Train/Samples/samples_per_sec", "Train/Samples/tokens_per_sec", "Train/Samples/memory_MiB_rank0"}


def test_crc32c_and_record_framing():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    framed = record(b"abc")
    assert framed[:8] == (3).to_bytes(8, "little") and framed[12:15] == b"abc" and len(framed) == 19
    assert int.from_bytes(framed[15:], "little") == masked_crc(b"abc")
    assert read_records(framed + record(b"")) == [b"abc", b""]
    with pytest.raises(ValueError, match="corrupt TFRecord at byte 0"):
        read_records(framed[:12] + b"abd" + framed[15:])


def test_event_protobuf_bytes():
    # Event{wall_time=1.0 (field 1, fixed64), step=300 (field 2, varint ac 02), summary (field 5)
    #   {value (1) {tag (1) "a", simple_value (2, fixed32) 0.5}}}
    ev = encode_scalar_event("a", 0.5, 300, 1.0)
    assert ev == (b"\x09" + bytes.fromhex("000000000000f03f") + b"\x10\xac\x02"
                  + b"\x2a\x0a\x0a\x08\x0a\x01a\x15" + bytes.fromhex("0000003f"))
    assert read_scalars(record(ev)) == [("a", 0.5, 300)]


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
    engine, obs, losses, norms = run_steps(
        tmp_path, tensorboard={"enabled": True, "output_path": out, "job_name": "tb"},
        csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"})
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
    scalars = read_scalars(event_file.read_bytes())
    assert {t for t, _, _ in scalars} == TAGS
    got = [(v, s) for t, v, s in scalars if t == "Train/Samples/train_loss"]
    assert [s for _, s in got] == samples
    assert [v for v, _ in got] == pytest.approx(mean_loss, rel=1e-6)  # stored as float32
    assert [v for t, v, _ in scalars if t == "Train/Samples/lr"] == pytest.approx([1e-3] * 3)
    assert [v for t, v, _ in scalars if t == "Train/Samples/loss_scale"] == [1.0] * 3
    tokens = [v for t, v, _ in scalars if t == "Train/Samples/tokens_per_sec"]
    sps = [v for t, v, _ in scalars if t == "Train/Samples/samples_per_sec"]
    assert all(tok == pytest.approx(s * 16, rel=1e-5) for tok, s in zip(tokens, sps))  # 16 tokens per sample

    assert plot_main([str(tmp_path / "csv")]) == 0
    assert (tmp_path / "csv" / "Train_Samples_train_loss.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_line_timers_profiler_and_comms(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="zerospeed.profiling.observer")
    run_steps(tmp_path, steps=2, steps_per_print=2, wall_clock_breakdown=True, memory_breakdown=True,
              comms_logger={"enabled": True}, flops_profiler={"enabled": True, "profile_step": 1, "detailed": False,
                                                              "output_file": str(tmp_path / "flops.txt")})
    messages = [r.getMessage() for r in caplog.records]
    progress = [m for m in messages if m.startswith("step 2 | samples 8 | loss ")]
    assert len(progress) == 1 and "| lr 1.000e-03 |" in progress[0] and "tokens/s" in progress[0]
    timing = [m for m in messages if m.startswith("step 2 time (ms) | forward: ")]
    assert len(timing) == 1 and "| backward: " in timing[0] and "| comm: " in timing[0]
    assert any(m.startswith("memory: allocated") for m in messages)
    assert any(m.startswith("communication totals:") for m in messages)
    profile = (tmp_path / "flops.txt").read_text()
    assert "profile step:                  1" in profile
    # one forward of micro-batch 2 x 16 tokens plus the loss: GPT logits count + cross-entropy (32 x 256)
    assert "forward FLOPs:                 7.73 MFLOPs" in profile


def test_everything_off_is_inactive_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, obs, _, _ = run_steps(tmp_path, steps=1)
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
