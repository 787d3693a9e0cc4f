"""AutoEP without processes: the dispatch plan, the expert split, detection, the config's refusals,
and (ep = 1, one process) the converted model equal to stock transformers. The expert-parallel
exchange itself is tested on 4 ranks in tests/dist/test_moe_autoep_parity.py."""

from __future__ import annotations

import copy

import pytest
import torch

from zerospeed.comm.mesh import ParallelMesh
from zerospeed.config import ConfigError, parse_config
from zerospeed.moe.autoep import (
    ExpertParallelExperts,
    apply_autoep,
    apply_autoep_config,
    autoep_settings,
    consolidated_state_dict,
    find_moe_blocks,
    local_expert_range,
    plan_dispatch,
    save_autoep_model,
)
from zerospeed.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

transformers = pytest.importorskip("transformers")


def mixtral(**kw):
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def qwen2_moe():
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg)


def ep_section(**keys):
    return parse_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, **keys}}).expert_parallel


def test_plan_sorts_pairs_by_expert_and_counts_rows_per_rank():
    idx = torch.tensor([[2, 0], [1, 2], [3, 0]])  # 3 tokens, top-2, 4 experts
    plan = plan_dispatch(idx, num_experts=4, ep_size=2)
    assert plan.choice_N.tolist() == [1, 5, 2, 0, 3, 4]  # expert 0: pairs 1, 5; 1: 2; 2: 0, 3; 3: 4
    assert plan.token_N.tolist() == [0, 2, 1, 0, 1, 2]
    assert plan.counts_E.tolist() == [2, 1, 2, 1]
    assert plan.send_rows == [3, 3]
    marker = plan_dispatch(torch.tensor([[4, 1]]), num_experts=4, ep_size=1)  # E marks "no expert": skipped
    assert marker.choice_N.tolist() == [1] and marker.counts_E.tolist() == [0, 1, 0, 0]


def test_local_expert_range_and_divisibility():
    assert local_expert_range(8, 4, 3) == range(6, 8)
    with pytest.raises(ConfigError, match="autoep_size=3 does not divide the model's 4 experts"):
        local_expert_range(4, 3, 0)


def test_container_at_ep1_equals_transformers_experts():
    stock = mixtral().model.layers[0].mlp.experts
    ours = ExpertParallelExperts(stock.gate_up_proj, stock.down_proj, stock.act_fn, 4, 1, 0, None)
    x = torch.randn(10, 32, requires_grad=True)
    idx = torch.randint(0, 4, (10, 2))
    w = torch.rand(10, 2, requires_grad=True)
    y_ref, y = stock(x, idx, w), ours(x, idx, w)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    g_ref = torch.autograd.grad(y_ref.square().sum(), [x, w, stock.gate_up_proj, stock.down_proj])
    g = torch.autograd.grad(y.square().sum(), [x, w, ours.gate_up_proj, ours.down_proj])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_container_slices_its_experts_and_registers_them():
    stock = mixtral().model.layers[0].mlp.experts
    ours = ExpertParallelExperts(stock.gate_up_proj, stock.down_proj, stock.act_fn, 4, 2, 1, None)
    assert torch.equal(ours.gate_up_proj, stock.gate_up_proj[2:]) and ours.down_proj.shape == (2, 32, 16)
    assert is_moe_param(ours.gate_up_proj) and not is_moe_param(stock.gate_up_proj)
    assert is_moe_param(copy.deepcopy(ours).down_proj)  # copies stay expert parameters
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(ours.parameters())})
    assert groups[1]["name"] == "ep_size_2" and groups[1]["moe"] is True


def test_detection_finds_mixtral_and_qwen2_moe_blocks():
    assert [n for n, _ in find_moe_blocks(mixtral())] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [n for n, _ in find_moe_blocks(qwen2_moe())] == ["model.layers.0.mlp"]  # layer 1 is dense


@pytest.mark.parametrize("build", [mixtral, qwen2_moe])
def test_converted_model_equals_stock_at_ep1_with_aux_loss(build):
    stock = build()
    stock.config.output_router_logits = True
    ours = copy.deepcopy(stock)
    params = apply_autoep_config(
        ours,
        ParallelMesh.data_parallel(),
        parse_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "autoep_size": 1}}),
        model_parameters=[{"params": list(ours.parameters()), "weight_decay": 0.1}],
    )
    assert {id(p) for p in params[0]["params"]} == {id(p) for p in ours.parameters()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    ref, out = stock(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert out.aux_loss is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=1e-6)
    plain = consolidated_state_dict(ours)
    assert plain.keys() == stock.state_dict().keys()
    assert all(torch.equal(plain[k], v) for k, v in stock.state_dict().items())


def test_preset_and_patterns_select_blocks():
    model = mixtral()
    spec, expect = autoep_settings(ep_section(preset_model="mixtral", top_k=2, route_norm=True), model)
    assert spec.moe_layer_pattern == r"model\.layers\.\d+\.mlp" and expect == {
        "top_k": 2,
        "route_norm": True,
        "num_experts": 4,
    }
    spec, _ = autoep_settings(ep_section(moe_layer_pattern=r"model\.layers\.1\.mlp"), model)
    assert [n for n, _ in find_moe_blocks(model, spec)] == ["model.layers.1.mlp"]
    with pytest.raises(ConfigError, match="preset_model='qwen3_moe' but the model's config.model_type is 'mixtral'"):
        autoep_settings(ep_section(preset_model="qwen3_moe"), model)


@pytest.mark.parametrize(
    "keys, match",
    [
        (
            {"expert_tensor_parallel_size": 2},
            "expert_parallel.expert_tensor_parallel_size=2: expert tensor parallelism",
        ),
        ({"comm_backend": "deepep"}, "expert_parallel.comm_backend='deepep'"),
        ({"load_balance_coeff": 0.001}, "expert_parallel.load_balance_coeff=0.001"),
        ({"num_expert_groups": 2}, "expert_parallel.num_expert_groups=2: group-limited routing"),
        ({"route_scale": 2.0}, "expert_parallel.route_scale=2.0"),
        ({"routed_scaling_factor": 2.5}, "expert_parallel.routed_scaling_factor=2.5"),
        ({"expert_w3": "up_proj"}, "expert_parallel.expert_w3='up_proj'"),
        ({"preset_model": "deepseek_v3"}, "expert_parallel.preset_model='deepseek_v3': the deepseek_v3 preset"),
        ({"top_k_attr": "nope"}, "expert_parallel.top_k_attr='nope': model.config has no attribute"),
    ],
)
def test_unimplemented_keys_are_errors_naming_them(keys, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(".", r"\.")):
        autoep_settings(ep_section(**keys), mixtral())


@pytest.mark.parametrize(
    "keys, key",
    [
        ({"top_k": 1}, "top_k"),
        ({"score_func": "sigmoid"}, "score_func"),
        ({"route_norm": False}, "route_norm"),
        ({"score_apply": "pre"}, "score_apply"),
    ],
)
def test_routing_that_differs_from_the_models_router_is_refused(keys, key):
    model = mixtral()
    spec, expect = autoep_settings(ep_section(**keys), model)
    with pytest.raises(ConfigError, match=f"expert_parallel.{key}: the config asks for"):
        apply_autoep(model, ParallelMesh.data_parallel(), 1, spec, expect)


def test_initialize_level_refusals():
    model = mixtral()
    cfg = parse_config({"train_batch_size": 1, "expert_parallel": {"enabled": True}})
    with pytest.raises(ConfigError, match="client optimizer instance"):
        apply_autoep_config(model, ParallelMesh.data_parallel(), cfg, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="use_data_before_expert_parallelism=true"):
        apply_autoep_config(
            model,
            ParallelMesh.data_parallel(),
            parse_config({"train_batch_size": 1, "use_data_before_expert_parallelism": True}),
        )
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4
        )
    )
    with pytest.raises(ConfigError, match="the model has no sparse-MoE block"):
        apply_autoep_config(dense, ParallelMesh.data_parallel(), cfg)


def test_save_autoep_model_loads_into_stock_transformers(tmp_path):
    stock = mixtral()
    ours = copy.deepcopy(stock)
    apply_autoep(ours, ParallelMesh.data_parallel(), 1)
    files = save_autoep_model(ours, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    plain, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in stock.state_dict().items())


class _Mesh:
    """A stand-in mesh of `dp` data-parallel ranks seen from rank 0 (only the size checks run)."""

    def __init__(self, dp: int):
        self.dp = dp

    def size(self, axis: str) -> int:
        return self.dp if axis in ("dp", "dp_sp") else 1


@pytest.mark.parametrize(
    "dp, ep, match",
    [
        (4, 3, "autoep_size=3 does not divide the data-parallel size 4"),
        (8, 8, "autoep_size=8 does not divide the model's 4 experts"),
    ],
)
def test_bad_sizes_are_refused_before_any_block_changes(dp, ep, match):
    model = mixtral()
    with pytest.raises(ConfigError, match=match):
        apply_autoep(model, _Mesh(dp), ep)
    assert not any(isinstance(m, ExpertParallelExperts) for m in model.modules())


def test_custom_weight_names_are_kept():
    stock = mixtral().model.layers[0].mlp.experts
    ours = ExpertParallelExperts(stock.gate_up_proj, stock.down_proj, stock.act_fn, 4, 1, 0, None, ("w13", "w2"))
    assert [n for n, _ in ours.named_parameters()] == ["w13", "w2"] and is_moe_param(ours.w_in)
    x, idx, w = torch.randn(5, 32), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    torch.testing.assert_close(ours(x, idx, w), stock(x, idx, w), rtol=0, atol=1e-6)
