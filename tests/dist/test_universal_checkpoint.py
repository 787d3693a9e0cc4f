"""Universal checkpoints (Note [universal folders] in checkpoint/deepspeed_import.py) both ways.

The fixtures `universal_zero{2,3}` are DeepSpeed 0.19.8's own `ds_to_universal` output for its ZeRO-2 and
ZeRO-3 runs of the fixture MLP after 3 of 6 steps (make_universal.py), with the losses DeepSpeed's own
continuation gave after `load_universal` (steps 4-6). zerospeed loads each folder with
`checkpoint.load_universal: true` (no tag: `latest_universal` names it) at another ZeRO stage and world
size and must continue with the same losses within 1e-6. A universal folder zerospeed writes
(`deepspeed_export.write_universal`) of DeepSpeed's ZeRO-1 tag must continue like DeepSpeed's own run did.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, continue_fixture_run, fixture_model, fixture_script


def model():
    return fixture_model(scale=2.0)


def _continue(folder: str, stage: int, tag=None):
    import zerospeed
    from zerospeed import comm

    world = comm.get_world_size()
    gas = 4 // world
    m = model()
    cfg = fixture_script("make").config(stage, gradient_accumulation_steps=gas, checkpoint={"load_universal": True})
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    path, _ = engine.load_checkpoint(folder, tag=tag)
    assert path is not None
    steps = engine.global_steps
    losses = continue_fixture_run(engine, m, gas)
    return {"losses": losses, "steps": steps}


def _cases(cases):
    return {(folder, stage): _continue(folder, stage) for folder, stage in cases}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world,cases",
    [(2, [("universal_zero2", 3), ("universal_zero3", 1)]), (1, [("universal_zero2", 0), ("universal_zero3", 2)])],
)
def test_deepspeeds_universal_folders_resume_like_deepspeed(world, cases):
    import json

    cases = [(str(FIXTURES / f), s) for f, s in cases]
    for rank_result in run_distributed(_cases, world, cases, timeout=200):
        for folder, stage in cases:
            want = json.loads((Path(folder) / "losses.json").read_text())["losses"]
            got = rank_result[folder, stage]
            assert got["steps"] == 3
            assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= 1e-6, (folder, stage, got, want)


def _from_written(folder: str):
    return _continue(folder, 2)


@pytest.mark.timeout(120)
def test_a_universal_folder_zerospeed_writes_resumes_like_deepspeed(tmp_path):
    from zerospeed.checkpoint.deepspeed_export import source_from_deepspeed, write_universal
    from zerospeed.checkpoint.deepspeed_import import is_universal_folder, read_deepspeed_checkpoint

    src = source_from_deepspeed(read_deepspeed_checkpoint(FIXTURES / "zero1" / "step3"))
    out = write_universal(src, tmp_path, "step3_universal", dp=2)
    assert is_universal_folder(out) and (tmp_path / "latest_universal").read_text() == "step3_universal"
    want = torch.load(FIXTURES / "zero1" / "deepspeed_run.pt", weights_only=True)["losses"][3:]
    got = run_distributed(_from_written, 2, str(tmp_path), timeout=100)[0]
    assert got["steps"] == 3
    assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= 1e-6, (got["losses"], want)


def _save_in_zerospeed(folder: str):
    """DeepSpeed's ZeRO-2 tag loaded at zerospeed's ZeRO 1 on 2 ranks, saved again by zerospeed."""
    import zerospeed

    m = model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.load_checkpoint(str(FIXTURES / "zero2"), tag="step3")
    engine.save_checkpoint(folder, tag="step3")


@pytest.mark.timeout(120)
def test_cli_export_of_a_zerospeed_checkpoint_rewrites_deepspeeds_files(tmp_path):
    """DeepSpeed's ZeRO-2 tag -> zerospeed (ZeRO 1) -> `zerospeed-ckpt export --to deepspeed --stage 2 --dp 2`
    gives DeepSpeed's files back, value for value (its config aside: zerospeed records its own); `--to
    universal` gives a folder that resumes like DeepSpeed's own run."""
    from harness.deepspeed_files import assert_same_contents
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_export import UNIVERSAL_INFO
    from zerospeed.checkpoint.deepspeed_import import _load

    run_distributed(_save_in_zerospeed, 2, str(tmp_path / "zs"), timeout=100)
    assert (
        main(["export", str(tmp_path / "zs"), str(tmp_path / "ds"), "--to", "deepspeed", "--stage", "2", "--dp", "2"])
        == 0
    )
    theirs_dir = FIXTURES / "zero2" / "step3"
    for path in sorted(theirs_dir.iterdir()):
        mine, theirs = _load(tmp_path / "ds" / "step3" / path.name), _load(path)
        for states in (mine, theirs):
            states.pop("ds_config")
            states.get("optimizer_state_dict", {}).pop("ds_config", None)
        if "model_states" in path.name:
            assert mine.pop("universal_checkpoint_info") == UNIVERSAL_INFO
        assert_same_contents(mine, theirs, path.name)
    assert main(["export", str(tmp_path / "zs"), str(tmp_path / "uni"), "--to", "universal", "--dp", "2"]) == 0
    want = torch.load(FIXTURES / "zero2" / "deepspeed_run.pt", weights_only=True)["losses"][3:]
    got = run_distributed(_from_written, 2, str(tmp_path / "uni"), timeout=100)[0]
    assert max(abs(a - b) for a, b in zip(got["losses"], want)) <= 1e-6, (got["losses"], want)
