"""Tools on 2 gloo ranks, in one spawn: `--measure` (predicted vs census-measured bytes per rank within
5% at stages 1-3) and the monitors recording every rank's memory through the engine observer."""

import pytest

from harness import run_distributed
from zerospeed.estimate.measure import Measurement, _probe_stages, format_measurements, measure, predict

# 512^2 = 262,144 > stage3_param_persistence_threshold (1e5): every layer is partitioned at stage 3
WIDTH, LAYERS = 512, 4


def _observed_run(out_dir: str) -> None:
    import torch

    import zerospeed
    from zerospeed.config import parse_config
    from zerospeed.profiling.observer import EngineObserver
    from zoo.models import TinyMLP

    base = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=TinyMLP(), config=base)
    cfg = parse_config(
        dict(base, csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "job"}),
        world_size=2,
        check_features=False,
    )
    obs = EngineObserver(cfg, rank=engine.global_rank)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    for _ in range(2):
        obs.on_forward_start(engine, x, y)
        loss = engine(x, y)
        obs.on_forward_end(engine)
        obs.on_backward_start(engine, loss)
        engine.backward(loss)
        obs.on_backward_end(engine)
        obs.on_step_start(engine)
        engine.step()
        obs.on_step_end(engine)
    obs.close()


def _both(out_dir: str) -> list[dict]:
    _observed_run(out_dir)
    return _probe_stages((1, 2, 3), "bf16", WIDTH, LAYERS)


@pytest.mark.timeout(120)
def test_measure_within_5_percent_and_monitors_record_every_rank(tmp_path):
    per_rank = run_distributed(_both, 2, str(tmp_path), timeout=100)
    rows = [
        Measurement(
            rank, r["stage"], 2, "bf16", r["params"], predict(r["params"], 2, r["stage"], "bf16"), r["measured"]
        )
        for rank, probes in enumerate(per_rank)
        for r in probes
    ]
    assert sorted((m.rank, m.stage) for m in rows) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    for m in rows:
        assert m.params == LAYERS * WIDTH * WIDTH
        assert abs(m.ratio - 1) <= 0.05, m
    # bf16 with fp32 gradient accumulation, N=2: stage 1 = (2 + 4 + 12/2) P, stage 2 = (2 + 4/2 + 12/2) P,
    # stage 3 = (2/2 + 4/2 + 12/2) P
    assert {m.stage: m.predicted for m in rows} == {1: 12 * 1_048_576, 2: 10 * 1_048_576, 3: 9 * 1_048_576}
    assert "| 2 | 1 | bf16 | 3 | 1,048,576 | 9.44 |" in format_measurements(rows)

    files = sorted(p.name for p in (tmp_path / "job").glob("*.csv"))
    assert "Train_Samples_memory_MiB_rank0.csv" in files and "Train_Samples_memory_MiB_rank1.csv" in files
    rows = (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,Train/Samples/train_loss" and [r.split(",")[0] for r in rows[1:]] == ["4", "8"]


def test_measure_refuses_unknown_stage():
    with pytest.raises(ValueError, match=r"--measure covers ZeRO stages \(0, 1, 2, 3\), got stage 4"):
        measure(world=2, stages=(4,))
