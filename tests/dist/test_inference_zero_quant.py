"""ZeRO-Inference with weight-only int8 / int4 quantization of the stored shards (Note [quantized
ZeRO-Inference shards]): two ranks, parameters offloaded to CPU memory (int8 also to NVMe files), against plain
transformers with
each linear layer's rank chunks fake-quantized by the block formula — logits, greedy tokens, the bytes a
census finds per rank and the bytes one forward gathers."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.reference import fake_quantize_stage3_units

WORLD, NEW = 2, 5
QUANT = {
    "int8": {"num_bits": 8, "group_size": 64},  # DeepSpeed's default: asymmetric
    "int4": {"num_bits": 4, "group_size": 32, "symmetric": True},
}
SERVED = {"int8": ("int8", "cpu"), "int4": ("int4", "cpu"), "int8, nvme": ("int8", "nvme")}


def make():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model.requires_grad_(False)


def _linear(settings):
    def chosen(name, module):
        return (
            (settings["num_bits"], settings["group_size"], settings.get("symmetric", False))
            if isinstance(module, torch.nn.Linear)
            else None
        )

    return chosen


def ids():
    return torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(3))


def _served(nvme_dir):
    import zerospeed
    from harness import census
    from zerospeed import comm

    out = {}
    for name, (quant, device) in SERVED.items():
        model = make()
        offload = {"device": device, **({"nvme_path": nvme_dir} if device == "nvme" else {})}
        engine = zerospeed.init_inference(
            model,
            dtype=torch.float32,
            quant={"weight": {"quantized_initialization": QUANT[quant]}},
            zero={"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0},
        )
        held = census.live_tensor_bytes()
        comm.STATS.reset()
        swap = engine.zero_engine.zero.param_swapper
        before = swap.file.bytes_read if swap else 0
        logits = engine(ids()).logits
        traffic = comm.STATS.snapshot()
        read = swap.file.bytes_read - before if swap else 0
        out[name] = {
            "logits": logits,
            "tokens": engine.generate(input_ids=ids(), max_new_tokens=NEW, do_sample=False),
            "census": held,
            "traffic": traffic,
            "quantized": engine.quantized,
            "read": read,
        }
        del engine, model, logits
    # DeepSpeed's ZeRO-Inference script: the training engine with a top-level weight_quantization section
    model = make().requires_grad_(True)
    engine, *_ = zerospeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "weight_quantization": {"quantized_initialization": QUANT["int8"]},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "stage3_param_persistence_threshold": 0,
            },
        },
    )
    with torch.no_grad():
        out["initialize"] = {
            "logits": engine(ids()).logits,
            "tokens": engine.module.generate(input_ids=ids(), max_new_tokens=NEW, do_sample=False),
        }
    # a ZeRO-3 leaf holds its norms in the same flat shard as its linear layers: quantizing it is refused
    try:
        zerospeed.init_inference(
            make(),
            dtype=torch.float32,
            quant={"weight": {"quantized_initialization": QUANT["int8"]}},
            zero={"stage": 3, "stage3_module_granularity_threshold": 10**6},
        )
        out["leaf"] = "built"
    except Exception as e:  # noqa: BLE001 (the message is the result)
        out["leaf"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return run_distributed(_served, WORLD, str(tmp_path_factory.mktemp("nvme")), timeout=150)


def _reference(name):
    from zerospeed.precision.quantize import wire_bytes

    model = make()
    units = fake_quantize_stage3_units(model, WORLD, _linear(QUANT[name]))
    with torch.no_grad():
        logits = model(ids()).logits
    tokens = model.generate(input_ids=ids(), max_new_tokens=NEW, do_sample=False)
    stored = {u: wire_bytes(chunk, *s) for u, chunk, s in units if s}
    plain = {u: chunk * 4 for u, chunk, s in units if not s}
    return logits, tokens, stored, plain


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(SERVED))
def test_quantized_zero_inference_matches_fake_quantized_transformers(served, name):
    quant, device = SERVED[name]
    logits, tokens, stored, plain = _reference(quant)
    assert make()(ids()).logits.sub(logits).abs().max() > 1e-3  # the quantization does change the model
    bits = QUANT[quant]["num_bits"]
    for rank, res in enumerate(served):
        r = res[name]
        assert sorted(r["quantized"]) == sorted(stored) and set(r["quantized"].values()) == {bits}
        assert (r["logits"] - logits).abs().max() <= 1e-5, rank
        assert torch.equal(r["tokens"], tokens), f"rank {rank}:\n{r['tokens']}\n!=\n{tokens}"
        # what this rank holds: the quantized linear shards (codes + scales [+ minimums]) and the other
        # shards in fp32; 64 KiB for the inputs and what torch keeps (NVMe: the shards are in the file)
        held = sum(stored.values()) + sum(plain.values())
        if device == "cpu":
            assert held <= r["census"] <= held + (64 << 10), (rank, r["census"], held)
        else:  # one forward reads every shard from the file once, as stored (slots padded to 4 KiB)
            pages = sum(-(-n // 4096) * 4096 for n in [*stored.values(), *plain.values()])
            assert held <= r["read"] <= pages, (rank, r["read"], held, pages)
        # one forward gathers every quantized unit once, as stored
        assert r["traffic"][f"all_gather_int{bits}"]["payload_bytes"] == WORLD * sum(stored.values())


@pytest.mark.timeout(200)
def test_quantized_shards_are_a_fraction_of_fp32():
    _, _, s8, _ = _reference("int8")
    _, _, s4, _ = _reference("int4")
    fp32 = sum(chunk * 4 for _, chunk, s in fake_quantize_stage3_units(make(), WORLD, _linear(QUANT["int8"])) if s)
    assert 0.25 < sum(s8.values()) / fp32 < 0.25 * (1 + 8 / 64) + 1e-9  # codes + scale and minimum per 64
    assert 0.125 < sum(s4.values()) / fp32 < 0.125 * (1 + 8 / 32) + 1e-9  # half-byte codes + scale per 32


@pytest.mark.timeout(200)
def test_training_config_weight_quantization_at_stage3_quantizes_the_stored_shards(served):
    logits, tokens, _, _ = _reference("int8")
    for rank, res in enumerate(served):
        assert (res["initialize"]["logits"] - logits).abs().max() <= 1e-5, rank
        assert torch.equal(res["initialize"]["tokens"], tokens), rank


def test_quantizing_a_layer_inside_a_zero3_leaf_is_refused_naming_it(served):
    for rank in served:
        assert (
            rank["leaf"].startswith("ConfigError: quant.weight: ") and "inside the ZeRO-3 leaf module" in rank["leaf"]
        )
        assert "self_attn.q_proj is to be stored quantized" in rank["leaf"], rank["leaf"]
