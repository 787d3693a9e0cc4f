"""`init_inference` in one process (tp = 1): dtype, forward and generate delegation, max_out_tokens,
checkpoint loading (safetensors file, directory, DeepSpeed's JSON description), refusals naming the key."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import zerospeed
from zerospeed.inference import InferenceEngine
from zerospeed.utils.errors import ConfigError

V = 37


def make(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


IDS = torch.tensor([[3, 4, 5, 6, 7]])


def test_default_dtype_is_deepspeeds_fp16():
    engine = zerospeed.init_inference(make())
    assert isinstance(engine, InferenceEngine) and next(engine.module.parameters()).dtype is torch.float16
    assert engine.config is engine.module.config  # what transformers pipelines read


def test_forward_and_generate_are_the_models():
    ref = make()
    want_logits = ref(IDS).logits
    want = ref.generate(IDS, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = zerospeed.init_inference(make(), dtype=torch.float32)
    torch.testing.assert_close(engine(IDS).logits, want_logits, rtol=0, atol=0)
    got = engine.generate(IDS, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, want)


def test_prompt_longer_than_max_out_tokens_is_refused():
    engine = zerospeed.init_inference(make(), dtype=torch.float32, max_tokens=4)
    with pytest.raises(ConfigError, match="the prompt has 5 tokens but max_out_tokens is 4"):
        engine.generate(IDS, max_new_tokens=2)


def test_kernel_inject_is_accepted_and_said(caplog):
    with caplog.at_level(logging.INFO):
        zerospeed.init_inference(make(), dtype=torch.float32, replace_with_kernel_inject=True)
    assert "replace_with_kernel_inject has no effect" in caplog.text


@pytest.mark.parametrize(
    "config,message",
    [
        ({"tensor_parallel": {"tp_size": 2}}, "tensor_parallel.tp_size = 2 needs a multiple of 2 ranks"),
        ({"use_triton": True}, "use_triton: true is not implemented"),
        ({"dtype": torch.int8}, "dtype: int8"),
    ],
)
def test_refusals_name_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        zerospeed.init_inference(make(), config)


@pytest.mark.parametrize("form", ["file", "directory", "json", "object"])
def test_checkpoint_loads_into_the_model(tmp_path, form):
    from safetensors.torch import save_file

    source = make(seed=1)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    description = {"type": "ds_model", "version": 1.0, "checkpoints": ["model.safetensors"]}
    (tmp_path / "ds.json").write_text(json.dumps(description))
    checkpoint = {
        "file": str(tmp_path / "model.safetensors"),
        "directory": str(tmp_path),
        "json": str(tmp_path / "ds.json"),
        "object": description,
    }[form]
    extra = {"base_dir": str(tmp_path)} if form == "object" else {}
    engine = zerospeed.init_inference(make(seed=2), dtype=torch.float32, checkpoint=checkpoint, **extra)
    torch.testing.assert_close(engine(IDS).logits, source(IDS).logits, rtol=0, atol=0)


def test_checkpoint_of_another_model_is_an_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"bogus.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ConfigError, match="does not match the model"):
        zerospeed.init_inference(make(), checkpoint=str(tmp_path / "x.safetensors"))


def test_meta_model_is_filled_from_the_checkpoint(tmp_path):
    source = make(seed=1)
    source.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = type(source)(source.config)
    with pytest.raises(ConfigError, match="the model is on the meta device; give `checkpoint`"):
        zerospeed.init_inference(model, dtype=torch.float32)
    engine = zerospeed.init_inference(model, dtype=torch.float32, checkpoint=str(tmp_path))
    torch.testing.assert_close(engine(IDS).logits, source(IDS).logits, rtol=0, atol=0)
