"""A zerospeed PipelineEngine checkpoint exported as DeepSpeed's pipeline tag (Note [pipeline export] in
checkpoint/deepspeed_pipeline.py) holds what the real DeepSpeed wrote.

zerospeed's pipeline engine loads DeepSpeed's step-3 tags of make_pipe_tied.py (a tied layer; ZeRO 1 on pp 2 x dp 2,
and ZeRO 0 on pp 2), saves its own checkpoint at ZeRO 0 (or, for pipe_tied_zero1, at ZeRO 1 or 2: its flat files)
at once, and `zerospeed-ckpt export --to deepspeed` writes it back for DeepSpeed's layout: the layer files, the
per-stage model states (DeepSpeed's stage parameter names, optimizer state, counters) and the ZeRO-1 partitions equal
DeepSpeed's own files, tensor for tensor (and, from ZeRO 1/2, `--to universal` equals the pipe_universal fixture).
That the real DeepSpeed loads the export and continues as zerospeed does is measured by
benchmarks/deepspeed_pipeline_differential.py (docs/checkpoints.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_same_contents, fixture_script
from zerospeed.checkpoint.cli import main
from zerospeed.checkpoint.deepspeed_import import _load
from zerospeed.checkpoint.deepspeed_pipeline import export_pipeline_universal

STAGE_KEYS = (
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "lr_scheduler",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
)


def _load_and_save(fixture: str, pp: int, out: str, zs_zero: int = 0) -> None:
    import zerospeed
    from zerospeed.pipe import PipelineModule, TiedLayerSpec

    net = PipelineModule(
        layers=fixture_script("make_pipe_tied").layers(TiedLayerSpec),
        num_stages=pp,
        loss_fn=torch.nn.MSELoss(),
        partition_method="uniform",
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zs_zero},
    }
    engine, *_ = zerospeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(str(FIXTURES / fixture), tag="step3")
    engine.save_checkpoint(out, tag="step3")


def _hyper(groups: list[dict]) -> list[dict]:
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "params")
    return [{k: g[k] for k in keep} for g in groups]


def _compare(mine: Path, theirs: Path, stages: int, dp: int, zero: int) -> None:
    for f in sorted(theirs.glob("layer_*")):
        assert_same_contents(torch.load(mine / f.name), torch.load(f), f.name)
    for s in range(stages):
        name = f"mp_rank_{s:02d}_model_states.pt"
        a, b = _load(mine / name), _load(theirs / name)
        if zero == 0:
            a["optimizer"]["param_groups"] = _hyper(a["optimizer"]["param_groups"])
            b["optimizer"]["param_groups"] = _hyper(b["optimizer"]["param_groups"])
        assert_same_contents({k: a[k] for k in STAGE_KEYS}, {k: b[k] for k in STAGE_KEYS}, name)
        for d in range(dp if zero == 1 else 0):
            name = f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt"
            a, b = _load(mine / name)["optimizer_state_dict"], _load(theirs / name)["optimizer_state_dict"]
            for x in (a, b):
                x["base_optimizer_state"]["param_groups"] = _hyper(x["base_optimizer_state"]["param_groups"])
                x.pop("ds_version")
            assert_same_contents(a, b, name)
    assert not list(theirs.glob("zero_pp_rank_*")) or zero == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fixture,world,dp,zero", [("pipe_tied_zero1", 4, 2, 1), ("pipe_tied_zero0", 2, 1, 0)])
def test_an_exported_pipeline_checkpoint_holds_what_deepspeed_wrote(tmp_path, fixture, world, dp, zero):
    run_distributed(_load_and_save, world, fixture, 2, str(tmp_path / "zs"), timeout=150)
    argv = [str(tmp_path / "zs"), str(tmp_path / "ds"), "--to", "deepspeed", "--stage", str(zero), "--dp", str(dp)]
    assert main(["export", *argv]) == 0
    assert (tmp_path / "ds" / "latest").read_text() == "step3"
    _compare(tmp_path / "ds" / "step3", FIXTURES / fixture / "step3", 2, dp, zero)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zs_zero", [1, 2])
def test_a_pipeline_checkpoint_saved_at_zero_1_2_exports_to_what_deepspeed_wrote(tmp_path, zs_zero):
    """zerospeed's own ZeRO-1/2 pipeline tag (per-rank flat files) exports to DeepSpeed's ZeRO-1 files and to the
    universal folder DeepSpeed's ds_to_universal made of the same step (the pipe_universal fixture)."""
    run_distributed(_load_and_save, 4, "pipe_tied_zero1", 2, str(tmp_path / "zs"), zs_zero, timeout=150)
    assert list((tmp_path / "zs" / "step3").glob("zero_pp_rank_*")) and not list(
        (tmp_path / "zs" / "step3").glob("layer_*-optim_states.pt")
    )
    argv = [str(tmp_path / "zs"), str(tmp_path / "ds"), "--to", "deepspeed", "--stage", "1", "--dp", "2"]
    assert main(["export", *argv]) == 0
    _compare(tmp_path / "ds" / "step3", FIXTURES / "pipe_tied_zero1" / "step3", 2, 2, 1)
    folder = export_pipeline_universal(tmp_path / "zs", tmp_path / "uni", dp=2)
    theirs = FIXTURES / "pipe_universal" / "step3_universal"
    names = sorted(p.relative_to(theirs) for p in (theirs / "zero").rglob("*.pt") if p.parent.name != "zero")
    assert names and names == sorted(
        p.relative_to(folder) for p in (folder / "zero").rglob("*.pt") if p.parent.name != "zero"
    )
    for name in names:
        assert_same_contents(_load(folder / name), _load(theirs / name), str(name))
