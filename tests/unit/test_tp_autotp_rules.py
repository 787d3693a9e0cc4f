"""AutoTP's decisions and errors in one process (tp = 1: every collective is the identity)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.parallel.tensor import (
    full_state_dict,
    grad_norm_squared,
    replica_counts,
    shard_model,
    tp_model_init,
    vocab_parallel_cross_entropy,
)


def _tiny(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=37, n_positions=8, n_embd=16, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_tp1_sharding_keeps_the_model(arch):
    model = _tiny(arch).eval()
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    want_loss = model(ids, labels=ids).loss
    want_sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = shard_model(model, None)
    got = model(ids, labels=ids).loss
    torch.testing.assert_close(got, want_loss, rtol=1e-6, atol=1e-6)
    sd = full_state_dict(model, None)
    assert set(sd) == set(want_sd)
    for name, value in want_sd.items():
        assert torch.equal(sd[name], value), name
    assert "lm_head" in report.layers
    got.backward()
    counts = replica_counts(model, 1)
    assert set(counts.values()) == {1}
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(grad_norm_squared(model, None).sqrt().float(), total)


def test_a_model_without_rules_is_refused_by_layer_name():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"no partition rules .* for 2 layer\(s\): \['0', '2'\].*layer_specs"):
        shard_model(net, None)


def test_an_unmatched_layer_is_named_with_the_rule_to_add():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
    )
    with pytest.raises(ValueError, match=r"no rule matches for 1 layer\(s\): \['score'\]") as err:
        shard_model(LlamaForSequenceClassification(cfg), None)
    assert '{"patterns": ["^score\\\\.weight$"], "partition_type": "skip"}' in str(err.value)
    specs = {"layer_specs": [{"patterns": [r"score\.weight$"], "partition_type": "skip"}]}
    report = shard_model(LlamaForSequenceClassification(cfg), None, partition_config=specs)
    assert report.layers["score"] == "skip" and report.layers["model.layers.0.mlp.up_proj"] == "column"


def test_tp_model_init_checks_the_group_size():
    # without a group it builds a tp mesh of tp_size ranks, which one process cannot hold
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by pp\*sp\*tp = 1\*1\*2 = 2"):
        tp_model_init(_tiny("gpt2"), 2)
    model = tp_model_init(_tiny("gpt2"), 1, dtype=torch.float64)
    assert model.lm_head.weight.dtype == torch.float64 and model.lm_head.weight is model.transformer.wte.weight


def test_vocab_parallel_ce_at_tp1_is_cross_entropy():
    logits = torch.randn(5, 11, requires_grad=True)
    target = torch.tensor([1, -100, 3, 10, 0])
    got = vocab_parallel_cross_entropy(logits, target, None)
    want = F.cross_entropy(logits, target)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)
    with pytest.raises(ValueError, match="one more"):
        vocab_parallel_cross_entropy(logits, target[:4], None)
