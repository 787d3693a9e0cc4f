"""Memory estimator: the ZeRO paper's example, DeepSpeed's documented tables, census, plan, CLI."""

import json

import pytest
import torch

from zerospeed.estimate import (
    ModelCensus,
    Option,
    Precision,
    Setup,
    census_of_config,
    census_of_module,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    parse_count,
    placed_model_states,
    plan_rows,
    recommend,
    stage_bytes,
    transformer_activation_bytes,
    zero2_rows,
    zero3_rows,
)
from zerospeed.estimate.cli import main
from zoo.models import GPT, GPTConfig

GIB = 2**30


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_devices(stage, expected_gb):
    # ZeRO paper, Figure 1: 7.5B parameters, N=64, mixed-precision Adam (K=12).
    total = sum(stage_bytes(7_500_000_000, 64, stage, Precision.of("fp16", "adam")).values())
    assert abs(total / 1e9 - expected_gb) <= 0.05


def test_stage_components_by_hand():
    # P=1000, N=4, fp16 Adam: stage 3 = (2 + 2 + 4 + 8)/4 per param
    assert stage_bytes(1000, 4, 3, Precision.of("fp16")) == {
        "parameters": 500.0,
        "gradients": 500.0,
        "master_weights": 1000.0,
        "optimizer_states": 2000.0,
    }
    assert stage_bytes(1000, 4, 1, Precision.of("fp32", "sgd")) == {
        "parameters": 4000,
        "gradients": 4000,
        "master_weights": 0.0,
        "optimizer_states": 0.0,
    }


def test_deepspeed_documented_zero3_table():
    rows = zero3_rows(2_851_000_000, 32_000_000, num_gpus_per_node=8, num_nodes=1)
    got = [(round(r.host_bytes / GIB, 2), round(r.device_bytes / GIB, 2)) for r in rows]
    assert got == [(71.69, 0.12), (127.45, 0.12), (63.72, 0.78), (127.45, 0.78), (1.43, 6.09), (127.45, 6.09)]
    assert [r.options for r in rows][:2] == [
        "offload_param=cpu , offload_optimizer=cpu , zero_init=1",
        "offload_param=cpu , offload_optimizer=cpu , zero_init=0",
    ]


def test_deepspeed_zero2_rule():
    # offload: host P*max(4*8, 16)*1.5, device 2P; none: host 4P*8*1.5, device 4P + 16P/8
    (off, on) = zero2_rows(1_000_000, num_gpus_per_node=8)
    assert (off.host_bytes, off.device_bytes) == (48_000_000, 2_000_000)
    assert (on.host_bytes, on.device_bytes) == (48_000_000, 6_000_000)


def test_all_live_prints_the_table(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 + 105 params
    rows = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert "325 total params" not in out and "0M total params" in out and "per CPU" in out
    assert rows[4].device_bytes == 4 * 220 + int(18 * 325 / 2)
    estimate_zero3_model_states_mem_needs_all_cold(2_851_000_000, 32_000_000, 8)
    assert "71.69GiB |   0.12GiB | offload_param=cpu" in capsys.readouterr().out


def test_census_counts_tied_weights_once_and_config_agrees_with_module():
    cfg = GPTConfig()
    model = GPT(cfg)
    c = census_of_module(model)
    assert c.total_params == model.num_parameters() == 120_576
    assert c.largest_layer_params == 64 * 256 + 256  # the MLP's fc layer
    from dataclasses import asdict

    cc = census_of_config(asdict(cfg))
    assert (cc.total_params, cc.largest_layer_params, cc.layers, cc.hidden, cc.heads) == (120_576, 16_640, 2, 64, 2)


def test_census_transformers_config_and_errors():
    # GPT-2 small style (bias, tied): 124,439,808 parameters with 1024 positions
    c = census_of_config(
        {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "vocab_size": 50257,
            "max_position_embeddings": 1024,
        }
    )
    assert c.total_params == 124_439_808
    # Llama-2-7B (gated SiLU MLP, RMSNorm without bias, untied head): its published 6,738,415,616
    llama = census_of_config(
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "vocab_size": 32000,
            "intermediate_size": 11008,
            "model_type": "llama",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
    )
    assert llama.total_params == 6_738_415_616
    with pytest.raises(ValueError, match="lacks hidden_size, vocab_size"):
        census_of_config({"num_hidden_layers": 2, "num_attention_heads": 2})


def test_parse_count():
    assert [parse_count(t) for t in ("7.5B", "350M", "125k", "1,234")] == [7_500_000_000, 350_000_000, 125_000, 1234]
    with pytest.raises(ValueError, match="not a parameter count: 'lots'"):
        parse_count("lots")


def test_offload_placement():
    prec = Precision.of("bf16")
    placed = placed_model_states(1000, 4, Option(2, True), prec)
    # stage 2: gradients reduce straight into the host's fp32 partition (zero/sharded.py `_host_grads`)
    assert placed["device"] == {"parameters": 2000, "gradients": 0.0, "master_weights": 0.0, "optimizer_states": 0.0}
    # stage 1 keeps its whole gradient buffer on the device until the step (bf16: 2 bytes x 1000)
    assert placed_model_states(1000, 4, Option(1, True), prec)["device"]["gradients"] == 2000.0
    assert placed["host"] == {
        "parameters": 0.0,
        "gradients": 1000.0,
        "master_weights": 1000.0,
        "optimizer_states": 2000.0,
    }
    p3 = placed_model_states(1000, 4, Option(3, True, True), prec, largest_layer_params=100)
    assert p3["device"]["parameters"] == 200.0 and p3["host"]["parameters"] == 500.0
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        placed_model_states(1000, 4, Option(2, True, True), prec)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO stage 1, 2 or 3"):
        placed_model_states(1000, 4, Option(0, True), prec)


def test_activation_formula():
    # s=2048, b=1, h=4096, a=32, eager attention: per layer s*b*h*(34 + 5*a*s/h) = 2048*4096*(34+80)
    per_layer = 2048 * 4096 * 114
    shape = dict(layers=2, hidden=4096, heads=32, seq_len=2048, micro_batch=1)
    assert transformer_activation_bytes(**shape, checkpointing=False, attention="eager") == 2 * per_layer
    assert (
        transformer_activation_bytes(**shape, checkpointing=True, attention="eager") == 2 * 2 * 2048 * 4096 + per_layer
    )
    # fused attention (the default) keeps no scores: s*b*h*34
    assert transformer_activation_bytes(**shape, checkpointing=False) == 2 * 2048 * 4096 * 34
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'eager'"):
        transformer_activation_bytes(**shape, checkpointing=False, attention="flash")


def test_recommend_picks_fastest_that_fits():
    census = ModelCensus(7_500_000_000, 0)
    rows = plan_rows(census, Setup(devices_per_node=8, nodes=8))
    assert len(rows) == 16
    assert recommend(rows, 200e9).label() == "stage 0"
    assert recommend(rows, 32e9).label() == "stage 1"
    assert recommend(rows, 20e9).label() == "stage 2"
    assert recommend(rows, 5e9).label() == "stage 3"
    # optimizer offload: the device keeps the 16-bit parameter shard, 2 x 7.5e9 / 64 = 0.234e9 bytes
    assert recommend(rows, 0.3e9).label() == "stage 3, offload_optimizer=cpu"
    assert recommend(rows, 0.2e9).label() == "stage 3, offload_optimizer=cpu, offload_param=cpu"
    big_layer = plan_rows(ModelCensus(7_500_000_000, 100_000_000), Setup(devices_per_node=8, nodes=8))
    assert recommend(big_layer, 0.1e9) is None  # even parameter offload gathers a 0.2e9-byte layer


def test_recommend_uses_checkpointing_before_stage_3():
    census = ModelCensus(100_000_000, 0, layers=24, hidden=1024, heads=16)
    rows = plan_rows(census, Setup(devices_per_node=4, micro_batch=8, seq_len=2048, attention="eager"))
    by_label = {r.label(): r for r in rows}
    s2_ckpt = by_label["stage 2, activation checkpointing"]
    # model states 2 + 14/4 bytes/param; activations: 24 layers' inputs + one layer recomputed
    one_layer = 2048 * 8 * 1024 * (34 + 5 * 16 * 2048 / 1024)
    assert s2_ckpt.device_total == 100_000_000 * 5.5 + 24 * 2 * 2048 * 8 * 1024 + one_layer
    assert by_label["stage 2"].device_total > s2_ckpt.device_total
    assert recommend(rows, s2_ckpt.device_total).label() == "stage 2, activation checkpointing"
    assert recommend(rows, s2_ckpt.device_total - 1).label() == "stage 3, activation checkpointing"


def test_cli_prints_plan_and_recommendation(capsys, tmp_path):
    assert main(["--params", "7.5B", "--devices-per-node", "8", "--nodes", "8", "--device-memory", "32"]) == 0
    out = capsys.readouterr().out
    assert "recommendation for 32 GB per device: stage 1" in out
    assert "|   120.00 |" in out and "|    31.41 |" in out and "|    16.64 |" in out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256, "block_size": 64}))
    assert main(["--model-config", str(cfg), "--micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "120,576 parameters" in out and "activations: not estimated" not in out
    assert main([]) == 2
    assert "give --params or --model-config" in capsys.readouterr().err
