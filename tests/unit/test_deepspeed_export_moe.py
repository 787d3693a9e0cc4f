"""The MoE export writes what DeepSpeed 0.19.8 itself writes for a model with `MoE` layers (Note [DeepSpeed MoE
checkpoints] in checkpoint/deepspeed_experts.py): each MoE fixture tag DeepSpeed saved
(tests/fixtures/deepspeed_0.19.8/moe_zero{S}_ep{EP}/step3: ZeRO 0/1/2, ep 2 and 1, 2 ranks) is read into the
export source, experts under global names, and written again at its stage, dp and ep; every file (the model
states, each expert file, the expp_rank_* / zero_pp_rank_* optimizer files) must equal DeepSpeed's, names
included, key by key and tensor by tensor. The same source written at another ep must read back unchanged.
The real DeepSpeed resuming an export of zerospeed's own MoE checkpoint is benchmarks/deepspeed_moe_differential.py.
"""

import pytest
import torch

from harness.deepspeed_files import FIXTURES, assert_same_contents
from zerospeed.checkpoint.deepspeed_experts import (
    moe_layers,
    read_deepspeed_moe_checkpoint,
    write_deepspeed_moe_tag,
)
from zerospeed.checkpoint.deepspeed_export import source_from_deepspeed, write_deepspeed_tag
from zerospeed.checkpoint.deepspeed_import import _load, read_deepspeed_checkpoint
from zerospeed.checkpoint.errors import CheckpointError

PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts"
DENSE = ["fc1.weight", "fc1.bias", "moe.deepspeed_moe.gate.wg.weight", "fc2.weight", "fc2.bias"]
EXPERTS = [f"{PREFIX}.{j}.0.{w}" for j in range(2) for w in ("weight", "bias")]


def _source(fixture: str):
    return source_from_deepspeed(
        read_deepspeed_moe_checkpoint(FIXTURES / fixture / "step3", group_names=[DENSE, EXPERTS])
    )


@pytest.mark.parametrize(
    "fixture, stage, ep",
    [("moe_zero0_ep2", 0, 2), ("moe_zero1_ep2", 1, 2), ("moe_zero2_ep2", 2, 2), ("moe_zero2_ep1", 2, 1)],
)
def test_export_rewrites_deepspeeds_own_moe_files(tmp_path, fixture, stage, ep):
    out = write_deepspeed_moe_tag(_source(fixture), tmp_path, "step3", stage=stage, dp=2, ep=ep)
    theirs = sorted(p.name for p in (FIXTURES / fixture / "step3").iterdir())
    assert sorted(p.name for p in out.iterdir()) == theirs
    for name in theirs:
        assert_same_contents(_load(out / name), _load(FIXTURES / fixture / "step3" / name), f"{fixture}/{name}")
    assert (tmp_path / "latest").read_text().strip() == "step3"


@pytest.mark.parametrize("stage, ep", [(2, 1), (1, 2), (0, 1), (0, 2)])
def test_another_layout_reads_back_unchanged(tmp_path, stage, ep):
    """DeepSpeed's ep-2 ZeRO-2 tag written for ZeRO `stage` at ep `ep` holds the same weights, moments and
    step under the same global names (a wrong expert placement would move a global expert's values)."""
    src = _source("moe_zero2_ep2")
    out = write_deepspeed_moe_tag(src, tmp_path, "t", stage=stage, dp=2, ep=ep)
    local = [f"{PREFIX}.{j}.0.{w}" for j in range(4 // ep) for w in ("weight", "bias")]
    back = read_deepspeed_moe_checkpoint(out, group_names=[DENSE, local])
    assert back.meta["ep_size"] == ep and back.stage == stage
    assert set(back.universal.tensors) == set(src.universal.tensors)
    for name, tensors in src.universal.tensors.items():
        for key, value in tensors.items():
            assert torch.equal(back.universal.tensors[name][key], value.reshape(-1)), (name, key)
        assert float(back.universal.scalars[name]["step"]) == 3.0
    expert_file = _load(out / "layer_0_expert_3_mp_rank_00_model_states.pt")
    assert torch.equal(expert_file[f"{PREFIX}.3.0.weight"], src.universal.tensors[f"{PREFIX}.3.0.weight"]["fp32"])


def test_moe_layers_and_refusals(tmp_path):
    names = ["a.weight", f"x.{PREFIX}.0.w", f"x.{PREFIX}.1.w", f"y.{PREFIX}.0.w"]
    assert moe_layers(names) == {f"x.{PREFIX}": 2, f"y.{PREFIX}": 1}
    with pytest.raises(CheckpointError, match=r"experts \[0, 2\]"):
        moe_layers([f"x.{PREFIX}.0.w", f"x.{PREFIX}.2.w"])
    src = _source("moe_zero2_ep2")
    with pytest.raises(CheckpointError, match="ZeRO stage 3"):
        write_deepspeed_moe_tag(src, tmp_path, "t", stage=3, dp=2, ep=2)
    with pytest.raises(CheckpointError, match="--ep"):
        write_deepspeed_moe_tag(src, tmp_path, "t", stage=2, dp=2, ep=4)
    with pytest.raises(CheckpointError, match="MoE"):  # the dense writer would name experts as dense weights
        write_deepspeed_tag(src, tmp_path, "t", stage=2, dp=2)
    with pytest.raises(CheckpointError, match="moe_zero2_ep2.*deepspeed_experts"):
        read_deepspeed_checkpoint(FIXTURES / "moe_zero2_ep2" / "step3")
