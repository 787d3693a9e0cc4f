"""ALST tiled compute against the untiled computation in plain PyTorch: values, gradients, and — by a
census of the tensors autograd saves — that the full intermediates are never kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.sequence.tiled import TiledMLP, tiled_cross_entropy_sum, tiled_mlp


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).double()


def test_tiled_mlp_equals_the_mlp_and_keeps_no_hidden_activation():
    x = torch.randn(2, 24, 8, dtype=torch.float64, requires_grad=True)
    ref_mlp, mlp = _mlp(), _mlp()
    ref = ref_mlp(x)
    ref.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    out, saved = _saved_numels(lambda: tiled_mlp(mlp, x2, shards=4))
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=1e-12)
    for p, q in zip(mlp.parameters(), ref_mlp.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    assert max(saved) < 48 * 32  # the [tokens, 32] hidden activation is not kept for the backward


def test_deepspeed_style_apply_and_grads_written_once():
    mlp, ref = _mlp(), _mlp()
    hits = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hits.append(p))
    x = torch.randn(3, 10, 8, dtype=torch.float64)
    out = TiledMLP.apply(lambda self, t: self(t), mlp, x, 5, list(mlp.parameters()))
    out.sum().backward()
    ref(x).sum().backward()
    assert len(hits) == 4  # one accumulation per parameter, as the ZeRO hooks expect
    for p, q in zip(mlp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


def test_tiled_cross_entropy_equals_full_logits_and_never_holds_them():
    torch.manual_seed(1)
    tokens, width, vocab = 64, 8, 50
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = -100
    ref = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction="sum")
    ref.backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out, saved = _saved_numels(lambda: tiled_cross_entropy_sum(h2, w2, labels, shards=8))
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h2.grad, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, weight.grad, rtol=1e-5, atol=1e-6)
    assert max(saved) < tokens * vocab  # no [tokens, vocab] tensor saved


def test_enable_tiled_mlp_on_a_transformers_llama_changes_nothing_but_memory():
    import pytest

    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerospeed.sequence.hf import enable_tiled_mlp

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                use_cache=False,
                attn_implementation="sdpa",
            )
        ).double()

    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    ref, tiled = llama(), llama()
    assert enable_tiled_mlp(tiled, shards=4) == 2
    assert list(tiled.state_dict()) == list(ref.state_dict())
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    loss, saved = _saved_numels(lambda: tiled(input_ids=ids, labels=ids).loss)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)
    assert 80 * 128 not in saved  # no [tokens, intermediate] activation kept
