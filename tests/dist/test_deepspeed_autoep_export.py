"""zerospeed's AutoEP checkpoints export to DeepSpeed 0.19.8's AutoEP layout (Note [DeepSpeed AutoEP export] in
checkpoint/deepspeed_autoep_export.py).

The independent reference is what the real DeepSpeed wrote: fixtures autoep_zero{0,1,2,3}_ep2 (make_autoep.py) hold
the tag DeepSpeed's AutoEP saved after 3 steps of a tiny Mixtral on 2 gloo ranks at ZeRO 0-3, ep 2. zerospeed trains
the same model, config and batches under its AutoEP at another layout (ZeRO 3, ep 1: every expert on every rank, so
the export has to cut the experts out again), with DeepSpeed's recorded losses of those 3 steps (within 1e-6), saves,
and exports at ZeRO 0, 1, 2 ep 2 (Python API) and at ZeRO 3 ep 2 (`zerospeed-ckpt export`): every file DeepSpeed
wrote is written, with the same keys in the same order, the same shapes and dtypes,
the same metadata (`ds_autoep_layers` with its placement and affine maps, `ds_zero_partition_groups`, partition
counts and fragment addresses) and values within 1e-6 (weights, fp32 masters, Adam moments). Left out: `ds_config`,
which is the saving library's config record (zerospeed's resolved config, DeepSpeed's as given); its stage and
autoep_size are checked. That the real DeepSpeed resumes such exports is benchmarks/deepspeed_autoep_differential.py.
DeepSpeed's own tags rewrite to each other the same way (read by deepspeed_autoep*.py, written at the other stage:
ZeRO 2 <-> 3, and the dp-4 ZeRO-3 tag, whose experts are cut over expert-data-parallel groups of 2, to itself).
The test can fail: with w1 and w3 swapped in the split of gate_up_proj (deepspeed_autoep_names.to_autoep) it stops
at layer_0_expert_0's `w1.0`, off by 0.059.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_files import FIXTURES, assert_like_deepspeeds_tag, fixture_script

pytest.importorskip("transformers")
make_autoep = fixture_script("make_autoep")  # DeepSpeed's model, batches and config


def _train_and_save(stage: int, ep: int, folder: str) -> list[float]:
    """3 steps of make_autoep's run under zerospeed's AutoEP at ZeRO `stage`, ep `ep`; saves tag `step3`."""
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    m = make_autoep.mixtral()
    cfg = make_autoep.config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})
    eng, *_ = zerospeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    losses = []
    for ids in make_autoep.batches(world)[:3]:  # (make.train_step: the rows, 2 micro-batches, the mean over ranks)
        losses.append(make_autoep.train_step(eng, make_autoep.loss_of(eng, ids), rank, world))
    eng.save_checkpoint(folder, tag="step3")
    return losses


def _assert_like_deepspeeds(tag_dir, fixture: str, stage: int) -> None:
    def check_config(cfg: dict, want: dict) -> None:
        assert cfg["zero_optimization"]["stage"] == want["zero_optimization"]["stage"] == stage
        assert cfg["expert_parallel"]["autoep_size"] == want["expert_parallel"]["autoep_size"] == 2

    assert_like_deepspeeds_tag(tag_dir, fixture, check_config, atol=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """zerospeed's checkpoint after 3 steps at ZeRO 3, ep 1, and the losses of those steps."""
    folder = tmp_path_factory.mktemp("autoep_export") / "zs"
    return folder, run_distributed(_train_and_save, 2, 3, 1, str(folder), timeout=200)[0]


@pytest.mark.timeout(240)
def test_export_equals_deepspeeds_autoep_tags(saved, tmp_path):
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_autoep_export import export_autoep_to_deepspeed

    folder, losses = saved
    recorded = torch.load(FIXTURES / "autoep_zero3_ep2" / "deepspeed_run.pt")["losses"][:3]
    assert max(abs(a - b) for a, b in zip(losses, recorded, strict=True)) <= 1e-6

    for stage in (0, 1, 2):
        tag = export_autoep_to_deepspeed(folder, tmp_path / f"z{stage}", stage=stage, dp=2, ep=2)
        _assert_like_deepspeeds(tag, f"autoep_zero{stage}_ep2", stage)
    argv = ["export", str(folder), str(tmp_path / "z3"), "--to", "deepspeed", "--stage", "3", "--dp", "2"]
    assert main([*argv, "--ep", "2"]) == 0
    assert (tmp_path / "z3" / "latest").read_text() == "step3"
    _assert_like_deepspeeds(tmp_path / "z3" / "step3", "autoep_zero3_ep2", 3)


@pytest.mark.timeout(240)
def test_export_refusals_name_the_fix(saved, tmp_path, capsys):
    """What is not written is refused with the reason and the fix; the dense writer refuses an AutoEP checkpoint."""
    from zerospeed.checkpoint.cli import main
    from zerospeed.checkpoint.deepspeed_autoep_export import export_autoep_to_deepspeed
    from zerospeed.checkpoint.deepspeed_export import export_to_deepspeed
    from zerospeed.checkpoint.deepspeed_import import _load
    from zerospeed.checkpoint.errors import CheckpointError

    zs = saved[0]
    with pytest.raises(CheckpointError, match="--sub-group-size"):
        export_autoep_to_deepspeed(zs, tmp_path / "out", stage=3, dp=2, sub_group_size=100)
    with pytest.raises(CheckpointError, match="--ep"):
        export_autoep_to_deepspeed(zs, tmp_path / "out", stage=2, dp=2, ep=3)
    with pytest.raises(CheckpointError, match="AutoEP"):
        export_to_deepspeed(zs, tmp_path / "out", stage=2, dp=2)
    assert main(["export", str(zs), str(tmp_path / "out"), "--stage", "1", "--dp", "4"]) == 0  # the saved ep 1
    assert _load(tmp_path / "out" / "step3" / "mp_rank_00_model_states.pt")["ds_autoep_layers"][0]["ep_size"] == 1
    assert main(["export", str(zs), str(tmp_path / "out"), "--stage", "3", "--dp", "4", "--ep", "8"]) == 1
    assert "pass another --ep" in capsys.readouterr().err


REWRITES = [  # (DeepSpeed's tag read, ZeRO stage and dp written, DeepSpeed's tag it must equal)
    ("autoep_zero2_ep2", 3, 2, "autoep_zero3_ep2"),
    ("autoep_zero3_ep2", 2, 2, "autoep_zero2_ep2"),
    ("autoep_zero3_ep2_dp4", 3, 4, "autoep_zero3_ep2_dp4"),  # expert-data-parallel groups of 2 ranks: [0, 2], [1, 3]
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read,stage,dp,want", REWRITES, ids=[f"{r[0]}-to-{r[3]}" for r in REWRITES])
def test_deepspeed_autoep_tag_rewrites_to_deepspeeds_other_tag(read, stage, dp, want, tmp_path):
    """A DeepSpeed AutoEP tag, read (deepspeed_autoep*.py) and written at another stage (or the same at dp 4), equals
    the tag DeepSpeed itself saved there from the same run (the two runs' weights agree within 1e-6)."""
    from zerospeed.checkpoint.deepspeed_autoep import (
        is_deepspeed_autoep_zero3_tag,
        read_deepspeed_autoep_zero3_checkpoint,
    )
    from zerospeed.checkpoint.deepspeed_autoep_export import write_deepspeed_autoep_tag
    from zerospeed.checkpoint.deepspeed_autoep_zero12 import read_deepspeed_autoep_zero12_checkpoint
    from zerospeed.checkpoint.deepspeed_export import source_from_deepspeed

    tag_dir = FIXTURES / read / "step3"
    reader = read_deepspeed_autoep_zero3_checkpoint if is_deepspeed_autoep_zero3_tag(tag_dir) else None
    src = source_from_deepspeed((reader or read_deepspeed_autoep_zero12_checkpoint)(tag_dir))
    tag = write_deepspeed_autoep_tag(src, tmp_path, "step3", stage=stage, dp=dp, ep=2)
    _assert_like_deepspeeds(tag, want, stage)
