"""Global expert names in checkpoints (Note [global expert names]), without processes."""

from torch import nn

from zerospeed.checkpoint.experts import (
    ExpertSpan,
    checkpoint_names,
    expert_file_name,
    globalize,
    is_expert_key,
)
from zerospeed.moe.layer import MoE

P = "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts"


def test_span_maps_local_and_global_names():
    span = ExpertSpan(layer=1, prefix=P, first=4, local=2, writer=True)  # ep rank 2 of ep 4, 8 experts
    assert span.globalize(f"{P}.0.0.weight") == f"{P}.4.0.weight"
    assert span.globalize(f"{P}.1.bias") == f"{P}.5.bias"
    assert span.globalize("blocks.1.moe.deepspeed_moe.gate.wg.weight") is None
    assert span.localize(f"{P}.5.bias") == f"{P}.1.bias"
    assert span.localize(f"{P}.6.bias") is None and span.localize(f"{P}.3.bias") is None
    assert span.expert_of(f"{P}.5.bias") == 5
    assert globalize(f"{P}.1.bias", [span]) == f"{P}.5.bias" and globalize("head.weight", [span]) == "head.weight"
    assert is_expert_key(f"{P}.0.weight", [span]) and not is_expert_key("head.weight", [span])
    assert expert_file_name(1, 5) == "layer_1_expert_5_mp_rank_00_model_states.pt"


def test_names_of_a_one_rank_moe_model():
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2))
    names = checkpoint_names(model)
    assert names.has_experts and names.spans[0].prefix == "1.deepspeed_moe.experts.deepspeed_experts"
    assert set(names.params.values()) == {n for n, _ in model.named_parameters()}  # ep 1: global = local
    assert names.module_keys == list(model.state_dict())
    assert names.specs["1.deepspeed_moe.experts.deepspeed_experts.1.weight"]["shape"] == [4, 4]
    assert not checkpoint_names(nn.Linear(2, 2)).has_experts


def test_stacked_expert_pieces_are_addressed_in_the_whole_tensor():
    """Note [stacked expert checkpoints]: AutoEP's [E/ep, ...] parameter keeps its name; a piece at local
    element k of ep rank 2 of ep 4 (experts 4-5 of 8, 6 x 3 elements each) is element 4 x 18 + k of the
    whole [8, 6, 3] tensor, so the ranks' pieces tile it."""
    import torch

    from zerospeed.checkpoint.experts import CheckpointNames
    from zerospeed.zero.shards import Piece, ShardEntry

    key = "model.layers.0.mlp.experts.gate_up_proj"
    span = ExpertSpan(
        layer=0, prefix="model.layers.0.mlp.experts", first=4, local=2, writer=False, stacked=(key,), total=8
    )
    assert span.globalize(key) == key and span.localize(key) == key and is_expert_key(key, [span])
    assert span.globalize("model.layers.0.mlp.gate.weight") is None
    names = CheckpointNames([span], {}, {key: {"shape": [8, 6, 3]}}, [key], {key: 4 * 18})
    master = torch.zeros(30)
    entry = ShardEntry(master, [Piece(key, 10, 0, 26), Piece("model.norm.weight", 0, 26, 4)])
    (moved,) = names.global_entries([entry])
    assert moved.master is master
    assert moved.pieces == [Piece(key, 4 * 18 + 10, 0, 26), Piece("model.norm.weight", 0, 26, 4)]
