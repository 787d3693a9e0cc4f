"""Weight-only int8 / int4 quantization of a tensor-parallel model (Note [quantized tensor-parallel layers]).

GPT-2 (fused c_attn, Conv1D layers, tied head) and a Llama with grouped-query attention (untied head)
are sharded by AutoTP at tp = 2 and 4 and quantized by `init_inference(quant=...)`. The reference is
plain transformers, in one process: the same unsharded model with each linear weight replaced by its
quantize -> dequantize round trip (the pure functions of `zerospeed.compression.weight_quant.groupwise`,
unit-tested against their error bound). With the local input features a multiple of the group size,
the sharded model must compute exactly that model: full logits within 1e-5 and greedy generation of a
left-padded batch token-identical. Every rank also reports its quantized bytes, which must equal the
formula; no quantized layer keeps a floating-point weight, and at tp 2 the ranks' slices add up to
the unsharded weights.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zoo.data import left_padded_prompts

V, NEW, PAD, GROUP = 37, 5, 0, 8
LENGTHS = (3, 6)
SETTINGS = {8: {"num_bits": 8, "group_size": GROUP}, 4: {"num_bits": 4, "group_size": GROUP, "symmetric": True}}


def make(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=V,
                n_positions=32,
                n_embd=32,
                n_layer=2,
                n_head=4,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=1,
                eos_token_id=1,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                bos_token_id=1,
                eos_token_id=1,
            )
        )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.eval()


def batch():
    return left_padded_prompts(LENGTHS, V, PAD, seed=5)


def run(model):
    ids, mask = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)


@torch.no_grad()
def fake_quantized(arch: str, bits: int):
    """The unsharded model, each linear weight (not the tied head) through quantize -> dequantize."""
    from zerospeed.compression.weight_quant.groupwise import dequantize, quantize

    model = make(arch)
    s = SETTINGS[bits]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for _name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not (tied and m is model.get_output_embeddings()):
            m.weight.copy_(dequantize(quantize(m.weight, bits, GROUP, s.get("symmetric", False))))
        elif type(m).__name__ == "Conv1D":  # [in, out]: groups along the input features
            m.weight.copy_(dequantize(quantize(m.weight.t(), bits, GROUP, s.get("symmetric", False))).t())
    return model


def _served(archs_bits):
    import zerospeed
    from zerospeed import comm

    out = {}
    for arch, bits in archs_bits:
        engine = zerospeed.init_inference(
            make(arch),
            tensor_parallel={"tp_size": comm.get_world_size()},
            dtype=torch.float32,
            quant={"weight": {"quantized_initialization": SETTINGS[bits]}},
        )
        layers = [engine.module.get_submodule(n) for n in engine.quantized]
        stored = sum(
            m.qdata.numel() + m.scale.nbytes + (m.minimum.nbytes if m.minimum is not None else 0) for m in layers
        )
        local = [tuple(m.local_shape) for m in layers]
        floats = [n for n, m in zip(engine.quantized, layers) if "weight" in m._parameters]
        out[(arch, bits)] = (*run(engine), stored, local, floats, type(layers[0]).__name__)
    return out


CASES = [("gpt2", 8), ("llama", 8), ("llama", 4)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp", [2, 4])
def test_quantized_tensor_parallel_model_equals_the_fake_quantized_reference(tp):
    results = run_distributed(_served, tp, CASES, timeout=180)
    for arch, bits in CASES:
        want_logits, want_tokens = run(fake_quantized(arch, bits))
        for rank, res in enumerate(results):
            logits, tokens, stored, local, floats, cls = res[(arch, bits)]
            where = f"{arch} int{bits} tp={tp} rank {rank}"
            assert cls.startswith("Quantized") and cls.endswith("ParallelLinear"), (where, cls)
            assert not floats, (where, floats)
            gap = (logits - want_logits).abs().max().item()
            assert gap <= 1e-5, f"{where}: max |dlogit| {gap:.2e}"
            assert torch.equal(tokens, want_tokens), f"{where}:\n{tokens}\n!=\n{want_tokens}"
            # codes (bits/8 a weight) + one fp32 scale per group (+ a minimum when asymmetric)
            per_group = 4 * (1 if SETTINGS[bits].get("symmetric") else 2)
            expected = sum(o * i * bits // 8 + o * (i // GROUP) * per_group for o, i in local)
            assert stored == expected, (where, stored, expected)
        if tp == 2:  # (2 kv heads: nothing replicated) the ranks' slices add up to the unsharded weights
            model = make(arch)
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            full = sum(
                m.weight.numel()
                for m in model.modules()
                if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
                and not (tied and m is model.get_output_embeddings())
            )
            assert sum(o * i for r in results for o, i in r[(arch, bits)][3]) == full, arch
