"""Sparse attention inside BERT: BertSparseSelfAttention, SparseAttentionUtils on transformers models,
and a fine-tune through zerospeed.initialize with the `sparse_attention` config block."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")  # before the imports that need it

import zerospeed  # noqa: E402
from zerospeed.config import parse_config  # noqa: E402
from zerospeed.ops.sparse_attention import (  # noqa: E402
    BertSparseSelfAttention,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
    TransformersBertSparseSelfAttention,
    build_sparsity_config,
)

SEQ, BLOCK = 32, 8


def bert_config(**overrides):
    values = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "num_labels": 2,
        "attn_implementation": "eager",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return transformers.BertConfig(**{**values, **overrides})


def test_bert_sparse_self_attention_equals_dense_reference():
    torch.manual_seed(0)
    config = bert_config()
    layer = BertSparseSelfAttention(config, FixedSparsityConfig(4, block=BLOCK, num_local_blocks=2))
    hidden = torch.randn(2, SEQ, config.hidden_size)
    keep = torch.ones(2, SEQ)
    keep[1, -5:] = 0
    extended = ((1.0 - keep) * -10000.0)[:, None, None, :]  # BERT's extended additive mask
    out = layer(hidden, extended)

    def split(x):
        return x.view(2, SEQ, 4, 8).transpose(1, 2)

    q, k, v = (split(proj(hidden)) for proj in (layer.query, layer.key, layer.value))
    layout = layer.sparse_self_attention.get_layout(SEQ)
    keep_blocks = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()
    mask = torch.zeros(keep_blocks.shape).masked_fill(~keep_blocks, -math.inf) + extended
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + mask, -1) @ v
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(2, SEQ, 32), atol=1e-6, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_dense_layout_reproduces_the_transformers_model(attn_implementation):
    torch.manual_seed(0)
    config = bert_config(attn_implementation=attn_implementation)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(0, 64, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -9:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    old = [layer.attention.self for layer in model.bert.encoder.layer]
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, max_position=64, sparsity_config=DenseSparsityConfig(4, block=BLOCK)
    )
    for layer, before in zip(model.bert.encoder.layer, old):
        assert isinstance(layer.attention.self, TransformersBertSparseSelfAttention)
        assert layer.attention.self.query.weight is before.query.weight  # the trained projections are kept
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        no_mask = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert no_mask.shape == got.shape


def test_roberta_is_replaced_too():
    config = transformers.RobertaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=66,
        attn_implementation="eager",
    )
    model = transformers.RobertaForMaskedLM(config)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(model, max_position=64)
    assert model.config.max_position_embeddings == 66
    assert isinstance(model.roberta.encoder.layer[0].attention.self, TransformersBertSparseSelfAttention)
    out = model(input_ids=torch.randint(3, 64, (1, SEQ)))
    assert out.logits.shape == (1, SEQ, 64)
    with pytest.raises(ValueError, match="BERT and RoBERTa"):
        SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(torch.nn.Linear(2, 2), 64)


def test_pad_to_block_size_and_unpad():
    ids = torch.arange(2 * 13).view(2, 13)
    mask = torch.ones(2, 13, dtype=torch.long)
    types = torch.ones(2, 13, dtype=torch.long)
    pad, ids2, mask2, types2, pos2, embeds2 = SparseAttentionUtils.pad_to_block_size(
        8, ids, mask, types, None, None, pad_token_id=0, model_embeddings=None
    )
    assert pad == 3 and ids2.shape == (2, 16) and pos2 is None and embeds2 is None
    assert ids2[:, 13:].eq(0).all() and mask2[:, 13:].eq(0).all() and types2[:, 13:].eq(0).all()
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad, ids2), ids)
    embeddings = torch.nn.Embedding(4, 5)
    pad, ids3, mask3, _, _, embeds3 = SparseAttentionUtils.pad_to_block_size(
        8, None, None, None, None, torch.zeros(2, 13, 5), pad_token_id=1, model_embeddings=embeddings
    )
    assert ids3 is None and embeds3.shape == (2, 16, 5) and torch.equal(embeds3[0, 13], embeddings.weight[1].detach())
    assert mask3[:, :13].eq(1).all() and mask3[:, 13:].eq(0).all()  # a missing mask still hides the padding
    assert SparseAttentionUtils.pad_to_block_size(8, ids[:, :8], mask[:, :8], types[:, :8], None, None, 0, None)[0] == 0


def test_extend_position_embedding_bert_and_roberta():
    model = transformers.BertForSequenceClassification(bert_config(max_position_embeddings=32))
    trained = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 80)
    weight = model.bert.embeddings.position_embeddings.weight
    assert weight.shape == (80, 32) and model.config.max_position_embeddings == 80
    assert (
        torch.equal(weight[:32], trained)
        and torch.equal(weight[32:64], trained)
        and torch.equal(weight[64:], trained[:16])
    )
    assert model(input_ids=torch.randint(0, 64, (1, 80))).logits.shape == (1, 2)  # the buffers grew too
    with pytest.raises(ValueError, match="must exceed"):
        SparseAttentionUtils.extend_position_embedding(model, 40)

    roberta = transformers.RobertaModel(
        transformers.RobertaConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=34,
        )
    )
    before = roberta.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(roberta, 64)
    after = roberta.embeddings.position_embeddings.weight
    assert after.shape == (66, 32) and roberta.config.max_position_embeddings == 66
    assert (
        torch.equal(after[:2], before[:2])
        and torch.equal(after[2:34], before[2:])
        and torch.equal(after[34:], before[2:])
    )


def test_update_tokenizer_model_max_length():
    tokenizer = SimpleNamespace(model_max_length=512, init_kwargs={})
    assert SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 4096) is tokenizer
    assert tokenizer.model_max_length == 4096 and tokenizer.init_kwargs == {"model_max_length": 4096}


def test_bert_fine_tune_with_the_sparse_attention_config_block():
    """A tiny BERT, random init, sparse attention from the config block, trained by zerospeed's engine."""
    torch.manual_seed(0)
    random.seed(0)
    ds_config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
        "sparse_attention": {
            "mode": "bigbird",
            "block": BLOCK,
            "num_random_blocks": 1,
            "num_sliding_window_blocks": 3,
            "num_global_blocks": 1,
        },
    }
    config = bert_config()
    model = transformers.BertForSequenceClassification(config)
    sparsity = build_sparsity_config(parse_config(ds_config).sparse_attention, config.num_attention_heads)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(model, 64, sparsity)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (16, 64), generator=gen)
    labels = (ids[:, -1] >= 34).long()  # the label is read from the last token: attention has to carry it
    ids[:, 0] = 2
    losses = []
    for _ in range(40):
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses
    attention = model.bert.encoder.layer[0].attention.self.sparse_self_attention
    assert attention.plan(64, 4, torch.device("cpu")).density < 0.6  # 8 x 8 blocks, most of them skipped
