"""Tests for the deterministic tiny models in zoo.models."""

import math

import pytest
import torch

from zoo.models import GPT, GPTConfig, TinyMLP


def _gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kw))


# --- TinyMLP -----------------------------------------------------------------------------


def test_tiny_mlp_logits_shape_and_layer_count():
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, d_hidden=32, d_out=8, n_layers=3)
    assert model(torch.randn(5, 16)).shape == (5, 8)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(16, 32), (32, 32), (32, 32), (32, 8)]


def test_tiny_mlp_loss_is_mse_scalar():
    torch.manual_seed(0)
    model = TinyMLP()
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    loss = model(x, y)
    assert loss.dim() == 0
    assert torch.allclose(loss, ((model(x) - y) ** 2).mean())


def test_tiny_mlp_rejects_zero_layers():
    with pytest.raises(ValueError, match="n_layers >= 1"):
        TinyMLP(n_layers=0)


def test_tiny_mlp_deterministic_under_seed():
    torch.manual_seed(3)
    a = TinyMLP()
    torch.manual_seed(3)
    b = TinyMLP()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


# --- GPT ---------------------------------------------------------------------------------


def test_gpt_logits_shape():
    model = _gpt()
    idx = torch.randint(0, 256, (3, 10))
    assert model(idx).shape == (3, 10, 256)


def test_gpt_loss_near_uniform_at_init():
    model = _gpt()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 64), generator=g)
    tgt = torch.randint(0, 256, (4, 64), generator=g)
    loss = model(idx, tgt)
    assert loss.dim() == 0
    # Uniform over 256 bytes: ln(256) = 5.545...; std-0.02 init keeps logits tiny.
    assert abs(loss.item() - math.log(256)) < 0.05


def test_gpt_head_is_tied_to_token_embedding():
    model = _gpt()
    assert model.lm_head.weight is model.wte.weight
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1


def test_gpt_num_parameters_counts_tied_weight_once():
    model = _gpt(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=True)
    V, T, D, L = 256, 64, 64, 2
    per_block = (
        2 * (D + D)  # two LayerNorms (weight + bias)
        + (D * 3 * D + 3 * D)  # qkv
        + (D * D + D)  # attention projection
        + (D * 4 * D + 4 * D)  # mlp fc
        + (4 * D * D + D)  # mlp projection
    )
    expected = V * D + T * D + L * per_block + (D + D)  # wte (shared with head), wpe, blocks, ln_f
    assert model.num_parameters() == expected == 120_576


def test_gpt_without_bias_has_no_bias_parameters():
    model = _gpt(bias=False)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_gpt_init_values():
    model = _gpt(n_layer=1)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
    w = model.blocks[0].mlp.fc.weight
    assert abs(w.std().item() - 0.02) < 0.002


def test_gpt_deterministic_under_seed():
    a, b, c = _gpt(seed=7), _gpt(seed=7), _gpt(seed=8)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.wte.weight, c.wte.weight)
    idx = torch.randint(0, 256, (2, 16))
    assert torch.equal(a(idx), b(idx))


def test_gpt_is_causal():
    model = _gpt()
    idx = torch.randint(0, 256, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    before, after = model(idx), model(changed)
    assert torch.allclose(before[:, :12], after[:, :12], atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_gpt_rejects_too_long_sequence():
    model = _gpt(block_size=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(3\)"):
        GPTConfig(n_embd=10, n_head=3)


def test_gpt_gradients_reach_every_parameter():
    model = _gpt()
    idx = torch.randint(0, 256, (2, 8))
    model(idx, idx).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
