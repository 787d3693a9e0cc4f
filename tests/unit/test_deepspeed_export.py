"""The DeepSpeed export writes what DeepSpeed 0.19.8 itself writes: each fixture tag DeepSpeed saved
(tests/fixtures/deepspeed_0.19.8/zero{0..3}/step3) is read into the export source and written again at its
stage and dp, and every file must equal DeepSpeed's, key by key and tensor by tensor (DeepSpeed's pickled
classes compared by class name and state). The real DeepSpeed resuming an export is
benchmarks/deepspeed_differential.py --export."""

import math
from pathlib import Path

import pytest
import torch

from harness.deepspeed_files import assert_same_contents
from zerospeed.checkpoint.deepspeed_export import (
    UNIVERSAL_INFO,
    slice_mappings,
    source_from_deepspeed,
    stage3_partition,
    stage12_partition,
    sub_groups,
    write_deepspeed_tag,
)
from zerospeed.checkpoint.deepspeed_import import _load, read_deepspeed_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8"
TRAINABLE = [["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]]


def test_partition_math_against_deepspeed_formulas():
    # 83 elements on 2 ranks: aligned to 2 * 2 -> 84, 42 each, the last rank's partition padded by 1
    assert stage12_partition(83, 2) == (42, [0, 1])
    # 10 elements on 8 ranks: aligned to 16, 2 each: ranks 5.. hold padding only
    assert stage12_partition(10, 8) == (2, [0, 0, 0, 0, 0, 2, 2, 2])
    assert stage3_partition(24, 2) == 12 and stage3_partition(3, 2) == 2 and stage3_partition(3, 4) == 1
    assert sub_groups([5, 5, 5], 10**9) == [[0, 1, 2]]
    assert sub_groups([5, 5, 5], 6) == [[0, 1], [2]]
    assert sub_groups([5, 5, 5], 5) == [[0], [1], [2]]
    assert slice_mappings([32, 8, 8], ["a", "b", "c"], 42, 84) == [("c", 6, 0)]
    assert slice_mappings([32, 8, 8], ["a", "b", "c"], 0, 42) == [("a", 32, 0), ("b", 8, 32), ("c", 2, 40)]


def _zero_padding(flat: torch.Tensor, shapes: dict) -> None:
    """DeepSpeed leaves the ZeRO-3 padding of the last of 2 ranks uninitialised (the export writes zeros)."""
    offset = 0
    for shape in shapes.values():
        numel = math.prod(shape)
        part = math.ceil(numel / 2)
        flat.data[offset + numel - part : offset + part] = 0
        offset += part


@pytest.mark.parametrize(
    "fixture, stage",
    [("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("bf16_zero1", 1), ("bf16_zero2", 2), ("bf16_zero3", 3)],
)
def test_export_rewrites_deepspeeds_own_files(tmp_path, fixture, stage):
    """bf16_zero1 is DeepSpeed's BF16_Optimizer layout; every bf16 tag names its files bf16_zero_pp_rank_*."""
    tag_dir = FIXTURES / fixture / "step3"
    ckpt = read_deepspeed_checkpoint(tag_dir, group_names=TRAINABLE)
    out = write_deepspeed_tag(source_from_deepspeed(ckpt), tmp_path, "step3", stage=stage, dp=2)
    assert (tmp_path / "latest").read_text() == "step3"
    theirs_files = sorted(p.name for p in tag_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == theirs_files
    for name in theirs_files:
        mine, theirs = _load(out / name), _load(tag_dir / name)
        if "model_states" in name:  # our addition, which ds_to_universal requires (DeepSpeed's own client state)
            assert mine.pop("universal_checkpoint_info") == UNIVERSAL_INFO
        if stage == 3 and name.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt"):
            _zero_padding(theirs["optimizer_state_dict"]["fp32_flat_groups"][0], ckpt.layout["shapes"])
        assert_same_contents(mine, theirs, name)


def test_export_to_another_stage_and_dp_keeps_the_values(tmp_path):
    """ZeRO-2 on 2 ranks -> ZeRO-3 on 3 ranks and ZeRO-1 on 4: reading each back gives the same full tensors."""
    ckpt = read_deepspeed_checkpoint(FIXTURES / "zero2" / "step3")
    src = source_from_deepspeed(ckpt)
    for stage, dp in ((3, 3), (1, 4)):
        out = write_deepspeed_tag(src, tmp_path / f"s{stage}", "t", stage=stage, dp=dp)
        back = read_deepspeed_checkpoint(out)
        assert back.stage == stage and back.dp == dp
        for name, tensors in ckpt.universal.tensors.items():
            for key, value in tensors.items():
                torch.testing.assert_close(back.universal.tensors[name][key], value, rtol=0, atol=0)
