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
