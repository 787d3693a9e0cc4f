"""Pure math of tensor-parallel slicing and AutoTP rule resolution: exact values, no processes."""

from __future__ import annotations

import pytest
import torch

from zerospeed.parallel.tensor import partition as P
from zerospeed.parallel.tensor.plan import PRESETS, first_match, hf_plan_rules, resolve_rules


def test_even_and_balanced_ranges():
    assert [P.even_range(12, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert [P.balanced_range(37, 4, r) for r in range(4)] == [(0, 10), (10, 9), (19, 9), (28, 9)]
    assert sum(n for _, n in (P.balanced_range(50257, 8, r) for r in range(8))) == 50257


def test_not_divisible_lists_the_valid_tp_sizes():
    with pytest.raises(
        ValueError,
        match=r"out_features = 12 is not divisible by the tensor-parallel size 5; "
        r"valid tp sizes: \[1, 2, 3, 4, 6, 12\]",
    ):
        P.column_spec(12, 5, 0, "out_features")


def test_fused_qkv_takes_each_ranks_heads_of_q_k_and_v():
    # hidden 8 = 4 heads of 2; tp 2: rank 1 holds heads 2, 3 of q, of k and of v
    spec = P.fused_spec([8, 8, 8], 2, 1, unit=2)
    assert spec.segments == ((4, 4), (12, 4), (20, 4)) and spec.local_size == 12 and spec.full_size == 24
    full = torch.arange(24.0).unsqueeze(1)
    assert P.take(full, spec).squeeze(1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    with pytest.raises(ValueError, match="valid tp sizes"):
        P.fused_spec([8, 8, 8], 3, 0, unit=2)


def test_fused_shape_forms():
    assert P.fused_sizes([3, -1], 24) == [8, 8, 8]
    assert P.fused_sizes([[16, 4, 4], -1], 24) == [16, 4, 4]
    with pytest.raises(ValueError, match="sum to 20"):
        P.fused_sizes([[8, 8, 4], -1], 24)


def test_gqa_head_layouts():
    # 8 q heads, 2 kv heads
    assert P.head_layout(8, 2, 2, 1) == P.HeadLayout(4, 4, 1, 1, 1)
    # tp 4 > 2 kv heads: each kv head on two ranks; rank 2's q heads 4, 5 read kv head 1
    layouts = [P.head_layout(8, 2, 4, r) for r in range(4)]
    assert [(lay.q_start, lay.q_heads, lay.kv_start, lay.kv_replicas) for lay in layouts] == [
        (0, 2, 0, 2),
        (2, 2, 0, 2),
        (4, 2, 1, 2),
        (6, 2, 1, 2),
    ]
    assert all(lay.kv_groups == 2 for lay in layouts)
    # every rank's q heads really use its kv head (q head h uses kv head h // (8 // 2))
    for lay in layouts:
        assert {h // 4 for h in range(lay.q_start, lay.q_start + lay.q_heads)} == {lay.kv_start}
    assert P.head_layout(4, 1, 4, 3) == P.HeadLayout(3, 1, 0, 1, 4)


def test_head_counts_that_cannot_split_name_the_valid_sizes():
    assert P.valid_attention_tp_sizes(12, 4) == [1, 2, 4, 12]  # 3 divides 12 but neither divides nor is a multiple of 4
    with pytest.raises(
        ValueError,
        match=r"12 query heads and 4 kv heads cannot be split over tp=3 ranks; "
        r"valid tp sizes: \[1, 2, 4, 12\]",
    ):
        P.head_layout(12, 4, 3, 0)


def test_take_and_assemble_are_inverse_including_replicas():
    full = torch.arange(6 * 4.0).view(6, 4)
    layouts = [P.head_layout(4, 1, 2, r) for r in range(2)]  # both ranks hold the single kv head
    kv = [P.heads_spec(lay, 6, 1, kv=True) for lay in layouts]
    assert kv[0] == kv[1] == P.ShardSpec(0, 6, ((0, 6),), 2)
    rows = [P.column_spec(6, 3, r) for r in range(3)]
    cols = [P.row_spec(4, 2, r) for r in range(2)]
    for specs in (kv, rows, cols):
        assert torch.equal(P.assemble([P.take(full, s) for s in specs], specs), full)
    with pytest.raises(ValueError, match="do not cover"):
        P.assemble([P.take(full, rows[0])], rows[:1])


def test_hf_plan_rules_match_transformers_keys():
    rules = hf_plan_rules({"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    assert first_match("model.layers.11.self_attn.q_proj.weight", rules).kind == "column"
    assert first_match("model.layers.0.mlp.down_proj.weight", rules).kind == "row"
    assert first_match("model.layers.0.mlp.down_proj.bias", rules) is None
    with pytest.raises(ValueError, match="'local_rowwise' is not a partition style"):
        hf_plan_rules({"layers.*.mlp.down_proj": "local_rowwise"})


def test_rule_priority():
    custom = {"layer_specs": [{"patterns": [r".*\.c_proj\.weight$"], "partition_type": "skip"}]}
    rules = resolve_rules(partition_config=custom, model_type="gpt2")
    assert first_match("transformer.h.0.attn.c_proj.weight", rules).kind == "skip"  # custom first
    assert first_match("transformer.h.0.mlp.c_fc.weight", rules).source == "preset gpt2"  # defaults merged
    only = resolve_rules(partition_config={**custom, "use_default_specs": False}, model_type="gpt2")
    assert first_match("transformer.h.0.mlp.c_fc.weight", only) is None
    plan = {"layers.*.mlp.up_proj": "colwise"}
    assert resolve_rules(tp_plans=[plan], model_type="llama")[0].source.startswith("tp_plan")  # model plan > preset
    assert resolve_rules(tp_plans=[plan], model_type="llama", preset_model="llama") == PRESETS["llama"]
    typed = {"layer_specs": [{"patterns": ["x"], "partition_type": "row", "model_types": ["opt"]}]}
    assert resolve_rules(partition_config=typed, model_type="gpt2") == PRESETS["gpt2"]
    with pytest.raises(ValueError, match="partition_type = 'diagonal'"):
        resolve_rules(partition_config={"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})
    with pytest.raises(ValueError, match="preset_model = 'bloom' is not known"):
        resolve_rules(preset_model="bloom")


def test_parsed_config_section_is_accepted():
    from zerospeed.config.schema.parallel import TpPartitionConfig

    parsed = TpPartitionConfig(
        layer_specs=[
            {"patterns": [r".*\.q\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0}
        ]
    )
    rule = resolve_rules(partition_config=parsed)[0]
    assert rule.kind == "column" and rule.shape == (3, -1)
