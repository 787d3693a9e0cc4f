"""DeepSpeed's AutoEP tags (the only MoE DeepSpeed 0.19.8 trains at ZeRO 3) are not misread by the dense and MoE
readers: a ZeRO-2 one and a ZeRO-3 one are each sent to their own reader (deepspeed_autoep_zero12.py,
deepspeed_autoep.py, through engine.load_checkpoint: tests/dist/test_deepspeed_autoep.py).

Fixtures autoep_zero{2,3}_ep2 were saved by the real DeepSpeed (make_autoep.py). Before, the dense reader took
the ZeRO-3 tag for a plain one and returned rank 0's two experts as the whole stacked weight (`w1` [2, 8, 8] of
[4, 8, 8]); the ZeRO-2 tag has layer_i_expert_e files and reached the MoE reader.
"""

import pytest
import torch

from harness.deepspeed_files import FIXTURES
from zerospeed.checkpoint.deepspeed_autoep import is_deepspeed_autoep_zero3_tag, read_deepspeed_autoep_zero3_checkpoint
from zerospeed.checkpoint.deepspeed_autoep_zero12 import (
    is_deepspeed_autoep_zero12_tag,
    read_deepspeed_autoep_zero12_checkpoint,
)
from zerospeed.checkpoint.deepspeed_experts import is_deepspeed_moe_tag, read_deepspeed_moe_checkpoint
from zerospeed.checkpoint.deepspeed_import import _load, read_deepspeed_checkpoint
from zerospeed.checkpoint.errors import CheckpointError

WHERE = r"autoep_zero{}_ep2/step3: a DeepSpeed AutoEP checkpoint \(ds_autoep_layers: \['model\.layers\.0\.mlp'\]\)"


def test_fixtures_are_what_deepspeed_writes_for_autoep():
    zero3 = FIXTURES / "autoep_zero3_ep2" / "step3"
    assert not is_deepspeed_moe_tag(zero3)  # no expert files at ZeRO 3: the dense reader would take it
    assert is_deepspeed_autoep_zero3_tag(zero3)
    layer = _load(zero3 / "zero_pp_rank_1_mp_rank_00_model_states.pt")["ds_autoep_layers"][0]
    assert (layer["checkpoint_format"], layer["ep_rank"], layer["global_expert_start"]) == ("zero3_partitioned", 1, 2)
    zero2 = FIXTURES / "autoep_zero2_ep2" / "step3"
    assert is_deepspeed_moe_tag(zero2) and not is_deepspeed_autoep_zero3_tag(zero2)
    assert len(torch.load(FIXTURES / "autoep_zero3_ep2" / "deepspeed_run.pt")["losses"]) == 6


def test_autoep_zero2_goes_to_its_reader():
    tag = FIXTURES / "autoep_zero2_ep2" / "step3"
    assert is_deepspeed_autoep_zero12_tag(tag)
    assert not is_deepspeed_autoep_zero12_tag(FIXTURES / "autoep_zero3_ep2" / "step3")
    for read in (read_deepspeed_checkpoint, read_deepspeed_moe_checkpoint):
        with pytest.raises(CheckpointError, match=WHERE.format(2) + " at ZeRO 1/2 is read by deepspeed_autoep_zero12"):
            read(tag)


def test_autoep_zero2_reader_matches_deepspeeds_own_weights():
    """The joined fp32 masters equal the weights DeepSpeed wrote beside them: the dense ones in
    mp_rank_00_model_states.pt, each global expert's w1 / w3 / w2 in its layer_0_expert_e file (the fixture's
    ep rank 1 holds experts 2-3: a wrong rank-to-ep-rank map or stacking order fails here)."""
    tag = FIXTURES / "autoep_zero2_ep2" / "step3"
    ckpt = read_deepspeed_autoep_zero12_checkpoint(tag)
    assert (ckpt.stage, ckpt.dp, ckpt.meta["ep_size"], ckpt.meta["global_steps"]) == (2, 2, 2, 3)
    assert ckpt.layout["shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 16, 8)
    for name, value in _load(tag / "mp_rank_00_model_states.pt")["module"].items():
        if ".gate.gate." not in name:  # (DeepSpeed's alias of the router)
            ours = ckpt.universal.tensors[name.replace("router.gate", "gate")]["fp32"]
            assert torch.equal(ours.view(value.shape), value.float()), name
    prefix = "model.layers.0.mlp.experts."
    gate_up = ckpt.universal.tensors[prefix + "gate_up_proj"]
    down = ckpt.universal.tensors[prefix + "down_proj"]
    assert set(gate_up) == {"fp32", "exp_avg", "exp_avg_sq"} and ckpt.universal.groups[prefix + "down_proj"] == 1
    for e in range(4):
        files = _load(tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
        assert torch.equal(gate_up["fp32"].view(4, 16, 8)[e, :8], files[f"{prefix}w1.{e}"].float())
        assert torch.equal(gate_up["fp32"].view(4, 16, 8)[e, 8:], files[f"{prefix}w3.{e}"].float())
        assert torch.equal(down["fp32"].view(4, 8, 8)[e], files[f"{prefix}w2.{e}"].float())


def test_autoep_zero3_goes_to_its_reader():
    tag = FIXTURES / "autoep_zero3_ep2" / "step3"
    with pytest.raises(CheckpointError, match=WHERE.format(3) + " at ZeRO 3 is read by deepspeed_autoep"):
        read_deepspeed_checkpoint(tag)
    ckpt = read_deepspeed_autoep_zero3_checkpoint(tag)
    # transformers' names and whole [E, ...] experts (DeepSpeed's w1 | w3 rows form gate_up_proj)
    assert ckpt.layout["shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 16, 8)
    assert ckpt.layout["shapes"]["model.layers.0.mlp.gate.weight"] == (4, 8)
    assert ckpt.meta["global_steps"] == 3 and ckpt.meta["ep_size"] == 2
