"""The estimator under tensor and pipeline parallelism: per-rank parameters and activations by hand.

Activations: Korthikanti et al. 2022, s*b*h*(34 + 5as/h) per layer at tp 1, s*b*h*(10 + 24/t + 5as/(ht))
at tp t, /t with sequence parallelism; a 1F1B stage holds pp - stage micro-batches. Parameters: the
Megatron / AutoTP layout (column and row splits, replicated norms and row biases, vocabulary-parallel
embedding and head); the same counts are checked against a census of real tp 2 shards in
tests/dist/test_estimate_profiler_tp.py.
"""

import json

import pytest

from zerospeed.estimate import (
    ModelCensus,
    Precision,
    Setup,
    census_of_config,
    plan_rows,
    stage_bytes,
    transformer_activation_bytes,
)
from zerospeed.estimate.cli import main
from zerospeed.estimate.layout import (
    TransformerShape,
    check_layout,
    in_flight,
    largest_module_params,
    layer_activation_bytes,
    layer_modules,
    stage_activation_bytes,
    stage_layers,
    stage_params,
    total_params,
    valid_tp,
)
from zerospeed.estimate.plan import layout_rows

# GPT-style: 4 layers, h 8, 2 heads (d 4), MLP 32, vocabulary 10, 6 positions, tied, biased.
GPT = TransformerShape(layers=4, hidden=8, vocab=10, heads=2, positions=6)
# Llama-style: 2 layers, h 16, 4 heads, 1 kv head, MLP 32 gated, vocabulary 37, untied, no biases.
LLAMA = TransformerShape(layers=2, hidden=16, vocab=37, heads=4, kv_heads=1, ffn=32, tied=False, bias=False, gated=True)


def test_gpt_layer_layout_by_hand():
    # tp 1: qkv 24*(8+1), out 8*8+8, fc 32*(8+1), proj 32*8+8, two LayerNorms 2*8 each = 12h^2 + 13h
    assert sum(a + r for a, r in layer_modules(GPT).values()) == 216 + 72 + 288 + 264 + 32 == 12 * 64 + 13 * 8
    # tp 2: q, k, v one head (4 rows) each; row biases and norms stay whole
    assert layer_modules(GPT, 2) == {
        "attn.qkv": (12 * 9, 0),
        "attn.out": (4 * 8, 8),
        "mlp.fc": (16 * 9, 0),
        "mlp.proj": (16 * 8, 8),
        "norm_1": (0, 16),
        "norm_2": (0, 16),
    }


def test_gpt_stage_params_by_hand():
    per_layer_tp2 = 108 + 40 + 144 + 136 + 32  # 460
    assert total_params(GPT) == 4 * 872 + 10 * 8 + 6 * 8 + 16 == 3632
    # tp 2: embedding rows 5 of 10; positions and final norm replicated; tied head shares the shard
    assert stage_params(GPT, tp=2) == [4 * per_layer_tp2 + 5 * 8 + 48 + 16]
    # pp 2: first stage embeddings, last stage final norm and its copy of the tied embedding
    assert stage_params(GPT, tp=2, pp=2) == [2 * 460 + 40 + 48, 2 * 460 + 16 + 40] == [1008, 976]
    # uneven vocabulary: rank 0 holds ceil(11 / 2) = 6 rows
    assert stage_params(TransformerShape(4, 8, 11, 2, positions=6), tp=2) == [4 * 460 + 48 + 48 + 16]
    assert largest_module_params(GPT, 2) == 144 and largest_module_params(GPT) == 288


def test_llama_gqa_layout_by_hand():
    # tp 1: q 16*16, k and v 4*16 (one kv head), o 16*16, gate/up/down 32*16, two RMSNorms 16
    assert total_params(LLAMA) == 2 * (256 + 64 + 64 + 256 + 3 * 512 + 32) + 2 * 37 * 16 + 16
    # tp 4 > 1 kv head: every rank keeps the one kv head (4 rows each), q/o one head, MLP 8 rows
    assert layer_modules(LLAMA, 4) == {
        "attn.q": (64, 0),
        "attn.k": (64, 0),
        "attn.v": (64, 0),
        "attn.o": (64, 0),
        "mlp.gate": (128, 0),
        "mlp.up": (128, 0),
        "mlp.down": (128, 0),
        "norm_1": (0, 16),
        "norm_2": (0, 16),
    }
    # untied head: embedding and head each ceil(37/4) = 10 rows on rank 0
    assert stage_params(LLAMA, tp=4) == [2 * 672 + 2 * 10 * 16 + 16]


def test_census_of_config_carries_the_shape():
    c = census_of_config(
        {
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "intermediate_size": 32,
            "vocab_size": 37,
            "model_type": "llama",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
    )
    assert c.shape == LLAMA and c.total_params == total_params(LLAMA)
    gpt = census_of_config({"n_embd": 8, "n_layer": 4, "n_head": 2, "vocab_size": 10, "n_positions": 6})
    assert gpt.shape == GPT and gpt.total_params == 3632


def test_activation_formulas_by_hand():
    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    one = dict(seq_len=s, micro_batch=b, hidden=h, heads=a, attention="eager")  # Korthikanti's scores term
    assert layer_activation_bytes(**one) == sbh * (34 + 80)
    fused = {**one, "attention": "sdpa"}  # fused attention keeps no scores
    assert layer_activation_bytes(**fused) == sbh * 34 and layer_activation_bytes(**fused, tp=4) == 16 * sbh
    assert layer_activation_bytes(**one, tp=4) == sbh * (10 + 24 / 4 + 80 / 4) == 36 * sbh
    assert layer_activation_bytes(**one, tp=4, sequence_parallel=True) == sbh * 114 / 4
    assert layer_activation_bytes(**one, tp=4, act_bytes=4) == 72 * sbh
    # 32 layers over pp 4: stage 0 holds 8 layers x 4 micro-batches (1F1B warm-up), the last stage 1
    assert stage_layers(32, 4) == [8, 8, 8, 8] and stage_layers(10, 4) == [3, 3, 2, 2]
    assert [in_flight(i, 4) for i in range(4)] == [4, 3, 2, 1] and in_flight(0, 4, micro_batches=2) == 2
    assert (
        stage_activation_bytes(layers=8, **one, checkpointing=False, tp=4, micro_batches_in_flight=4)
        == 8 * 4 * 36 * sbh
    )
    # checkpointing: each layer keeps its 16-bit input (split by tp under SP) per micro-batch in flight,
    # plus one layer recomputed
    assert (
        stage_activation_bytes(
            layers=8, **one, checkpointing=True, tp=4, sequence_parallel=True, micro_batches_in_flight=4
        )
        == 8 * 4 * 2 * sbh / 4 + sbh * 114 / 4
    )
    assert (
        transformer_activation_bytes(
            layers=2, hidden=h, heads=a, seq_len=s, micro_batch=b, checkpointing=False, tp=4, attention="eager"
        )
        == 2 * 36 * sbh
    )


def test_plan_rows_per_rank_with_tp_and_pp():
    census = ModelCensus(total_params(GPT), largest_module_params(GPT), 4, 8, 2, 6, GPT)
    setup = Setup(devices_per_node=8, micro_batch=2, seq_len=6, tp=2, pp=2)
    rows = plan_rows(census, setup)
    assert {r.dp for r in rows} == {2}
    prec = Precision.of("fp16")
    by_label = {r.label(): r for r in rows}
    s1 = by_label["stage 1"]
    # the first stage is the largest: 1008 parameters, 2 layers x 2 micro-batches in flight
    assert s1.stage == 0 and s1.layout_label() == "dp 2 x tp 2 x pp 2, pipeline stage 0"
    acts = 2 * 2 * layer_activation_bytes(seq_len=6, micro_batch=2, hidden=8, heads=2, tp=2)
    assert s1.device == dict(stage_bytes(1008, 2, 1, prec), activations=acts)
    # ZeRO-3 with parameter offload keeps the largest local module (144) gathered
    p3 = by_label["stage 3, offload_optimizer=cpu, offload_param=cpu"]
    assert p3.device["parameters"] == 144 * 2
    # tp 1 x pp 1 is the old plan (the census count over all devices)
    plain = plan_rows(census, Setup(devices_per_node=8, micro_batch=2, seq_len=6))
    assert plain[0].device["parameters"] == 3632 * 2 and plain[0].dp == 8


def test_layout_errors_name_the_flag_and_valid_values():
    gpt2 = TransformerShape(layers=12, hidden=768, vocab=50257, heads=12, positions=1024)
    assert check_layout(gpt2, 8, 2, 2) == 2
    assert valid_tp(gpt2, limit=16) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(
        ValueError,
        match=r"--tp 3 must divide the 8 devices .* 12 query heads .*valid --tp with "
        r"--pp 1: \[1, 2, 4\]",
    ):
        check_layout(gpt2, 8, 3, 1)
    with pytest.raises(ValueError, match=r"--tp 8 .*valid --tp with --pp 1: \[1, 2, 4\]"):
        check_layout(gpt2, 8, 8, 1)
    with pytest.raises(ValueError, match=r"--pp 3 does not divide the 8 devices .*valid --pp: \[1, 2, 4, 8\]"):
        check_layout(gpt2, 8, 1, 3)
    with pytest.raises(ValueError, match="--pp 16 exceeds the model's 12 layers; valid --pp: 1 to 12"):
        check_layout(gpt2, 16, 1, 16)
    with pytest.raises(ValueError, match="--tp/--pp need the model's layer shapes: give --model-config"):
        check_layout(None, 8, 2, 1)
    with pytest.raises(ValueError, match="--sequence-parallel needs --seq-len divisible by --tp 4, got 1022"):
        check_layout(gpt2, 8, 4, 1, seq_len=1022, sequence_parallel=True)
    with pytest.raises(ValueError, match="--tp must be >= 1, got 0"):
        check_layout(gpt2, 8, 0, 1)
    # GQA: tp may exceed the kv heads when it is a multiple of them
    assert valid_tp(LLAMA) == [1, 2, 4]


def test_layout_rows_list_every_valid_choice():
    census = ModelCensus(total_params(GPT), largest_module_params(GPT), 4, 8, 2, 6, GPT)
    rows = layout_rows(census, Setup(devices_per_node=4, seq_len=6), device_memory=1e9)
    assert [(s.dp, s.tp, s.pp) for s, _ in rows] == [(4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 1, 4), (1, 2, 2)]
    assert all(r is not None and r.label() == "stage 0" for _, r in rows)


def test_cli_tp_pp(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}))
    assert (
        main(
            [
                "--model-config",
                str(cfg),
                "--devices-per-node",
                "8",
                "--tp",
                "2",
                "--pp",
                "2",
                "--seq-len",
                "1024",
                "--micro-batch",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "layout: dp 2 x tp 2 x pp 2;" in out and "stage 1 [pipeline stage 0]" in out
    assert main(["--model-config", str(cfg), "--devices-per-node", "8", "--tp", "3"]) == 2
    assert "--tp 3 must divide" in capsys.readouterr().err
    assert main(["--params", "1B", "--devices-per-node", "2", "--tp", "2"]) == 2
    assert "give --model-config" in capsys.readouterr().err
    assert (
        main(
            [
                "--model-config",
                str(cfg),
                "--devices-per-node",
                "8",
                "--seq-len",
                "1024",
                "--layouts",
                "--device-memory",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dp x tp x pp" in out and "1 x 4 x 2" in out
    assert main(["--model-config", str(cfg), "--layouts"]) == 2
    assert "--layouts needs --device-memory" in capsys.readouterr().err
