"""Compression: quantizer, masks, bit schedule, config errors, init_compression, redundancy_clean."""

import io

import pytest
import torch
from torch import nn

from zerospeed.compression import init_compression, parse_compression_config, redundancy_clean
from zerospeed.compression.basic_layer import LinearLayer_Compress, QuantizedLinear
from zerospeed.compression.compress import student_initialization
from zerospeed.compression.prune import row_l1_mask, sparse_l1_mask, topk_mask, topk_mask_ste
from zerospeed.compression.quantize import bits_at_step, fake_quantize, quantize_codes, ste_quantize
from zerospeed.compression.scheduler import compression_scheduler
from zerospeed.utils.errors import ConfigError
from zoo.models import GPT, GPTConfig, TinyMLP


def wq_cfg(start=8, target=8, period=1, offset=0, groups=1, qtype="symmetric", modules=("net",)):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": offset,
                    "quantize_groups": groups,
                    "quantization_type": qtype,
                },
                "different_groups": {
                    "wq1": {
                        "params": {"start_bits": start, "target_bits": target, "quantization_period": period},
                        "modules": list(modules),
                    }
                },
            }
        }
    }


def state_bytes(model):
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()), buf.tell()


# -- quantizer -----------------------------------------------------------------------------------
def test_symmetric_round_trip_hand_values():
    w = torch.tensor([[-1.0, -0.5, 0.0, 0.26, 1.0]])
    c = quantize_codes(w, bits=3)  # qmax 3, scale 1/3
    assert c.codes.tolist() == [[-3.0, -2.0, 0.0, 1.0, 3.0]]
    assert torch.allclose(fake_quantize(w, 3), torch.tensor([[-1.0, -2 / 3, 0.0, 1 / 3, 1.0]]))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("groups", [1, 4])
def test_round_trip_error_within_half_step(symmetric, groups):
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    c = quantize_codes(w, 8, groups, symmetric)
    err = (fake_quantize(w, 8, groups, symmetric) - w).reshape(groups, -1).abs()
    assert (err <= c.scale / 2 + 1e-7).all()
    assert fake_quantize(fake_quantize(w, 8, groups, symmetric), 8, groups, symmetric).allclose(
        fake_quantize(w, 8, groups, symmetric), atol=1e-6
    )


def test_stochastic_rounding_is_unbiased():
    w = torch.full((20000,), 0.3)
    w[0] = 1.0  # fixes the scale at 1/127
    g = torch.Generator().manual_seed(0)
    q = fake_quantize(w, 8, stochastic=True, generator=g)[1:]
    assert abs(q.mean().item() - 0.3) < 1e-4
    assert set(torch.unique(torch.round(q * 127)).tolist()) == {38.0, 39.0}


def test_ste_gradient_is_identity():
    torch.manual_seed(0)
    w = torch.randn(4, 6, requires_grad=True)
    g = torch.randn(4, 6)
    (ste_quantize(w, 4) * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_bit_schedule_table():
    # DeepSpeed MoQ: one bit down when the step reaches the period, then the period doubles
    table = {0: 8, 9: 8, 10: 7, 19: 7, 20: 6, 39: 6, 40: 5, 79: 5, 80: 4, 10_000: 4}
    assert {s: bits_at_step(s, 8, 4, 10) for s in table} == table
    assert [bits_at_step(s, 8, 6, 1) for s in range(6)] == [8, 7, 6, 6, 6, 6]


def test_bit_schedule_through_scheduler_with_offset():
    model = TinyMLP()
    init_compression(model, wq_cfg(start=8, target=6, period=2, offset=3))
    sched = compression_scheduler(model)
    layer = model.net[0]
    seen = []
    for _ in range(9):
        seen.append(layer.current_bits())
        sched.step()
    # steps 0..8: off before 3, then 8 bits, one drop at offset+2, another at offset+4
    assert seen == [None, None, None, 8, 8, 7, 7, 6, 6]


# -- masks ---------------------------------------------------------------------------------------
def test_masks_equal_hand_computed():
    w = torch.tensor([[1.0, -4.0, 2.0], [0.5, 3.0, -0.1], [-2.0, 0.2, 0.3]])
    assert sparse_l1_mask(w, 0.4).tolist() == [[0, 1, 1], [0, 1, 0], [1, 0, 0]]  # ceil(3.6) = 4 kept
    assert row_l1_mask(w, 0.5).tolist() == [[1], [1], [0]]  # norms 7, 3.6, 2.5: keep 2
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5])
    assert topk_mask(scores, 0.5).tolist() == [0, 1, 1, 0]  # tie: first index wins


def test_topk_mask_passes_gradient_to_scores():
    scores = torch.tensor([0.1, 0.9, 0.5], requires_grad=True)
    m = topk_mask_ste(scores, 0.34)
    assert m.tolist() == [0, 1, 1]
    (m * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert scores.grad.tolist() == [1.0, 2.0, 3.0]


# -- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "block, key",
    [
        (
            {"weight_quantization": {"shared_parameters": {"enabeld": True}}},
            "compression_training.weight_quantization.shared_parameters.enabeld",
        ),
        (
            {"row_pruning": {"different_groups": {"g": {"params": {"dense_ratio": 1.5}}}}},
            "compression_training.row_pruning.different_groups.g.params.dense_ratio",
        ),
        (
            {"row_pruning": {"different_groups": {"g": {"params": {}}}}},
            "compression_training.row_pruning.different_groups.g.params.dense_ratio",
        ),
        (
            {"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}},
            "compression_training.weight_quantization.different_groups.g.params",
        ),
        ({"sparse_pruning": {"shared_parameters": {"enabled": True}}}, "compression_training.sparse_pruning"),
        (
            {"sparse_pruning": {"shared_parameters": {"method": "magnitude"}}},
            "compression_training.sparse_pruning.shared_parameters.method",
        ),
        (
            {
                "weight_quantization": {
                    "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["("]}}
                }
            },
            "compression_training.weight_quantization.different_groups.g",
        ),
    ],
)
def test_config_errors_name_the_key(block, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_compression_config({"compression_training": block})


def test_config_defaults_are_deepspeeds():
    cfg = parse_compression_config({"compression_training": {}})
    assert cfg.weight_quantization.shared_parameters.schedule_offset == 0
    assert cfg.sparse_pruning.shared_parameters.schedule_offset == 1000
    assert cfg.activation_quantization.shared_parameters.range_calibration == "dynamic"
    assert cfg.head_pruning.shared_parameters.method == "topk"


def test_unbuilt_technique_is_refused():
    block = {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "method": "snip_momentum"},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
        }
    }
    with pytest.raises(ConfigError, match=r"sparse_pruning\.shared_parameters\.method: \"snip_momentum\""):
        init_compression(TinyMLP(), {"compression_training": block})


def test_modules_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match=r"wq1\.modules"):
        init_compression(TinyMLP(), wq_cfg(modules=("nope",)))


# -- models --------------------------------------------------------------------------------------
def test_init_compression_quantizes_forward():
    torch.manual_seed(0)
    model = TinyMLP()
    x = torch.randn(5, 16)
    ref = model(x).detach()
    init_compression(model, wq_cfg(start=4, target=4))
    assert isinstance(model.net[0], LinearLayer_Compress)
    w = [model.net[i].weight for i in (0, 2, 4)]
    expect = x
    for i, wi in enumerate(w):
        layer = model.net[2 * i]
        expect = torch.nn.functional.linear(expect, fake_quantize(wi, 4), layer.bias)
        expect = torch.relu(expect) if i < 2 else expect
    out = model(x)
    assert torch.allclose(out, expect, atol=1e-6) and not torch.allclose(out, ref, atol=1e-3)
    out.sum().backward()
    assert model.net[0].weight.grad is not None


def test_engine_steps_the_schedule():
    import zerospeed

    torch.manual_seed(0)
    model = TinyMLP()
    cfg = wq_cfg(start=8, target=6, period=1, offset=1)
    init_compression(model, cfg)
    # DeepSpeed's flow: the same config (with its compression_training block) goes to initialize
    ds = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, **cfg}
    engine, *_ = zerospeed.initialize(model=model, config=ds)
    bits = []
    for _ in range(4):
        bits.append(model.net[0].current_bits())
        loss = engine(torch.randn(2, 16), torch.randn(2, 8))
        engine.backward(loss)
        engine.step()
    assert bits == [None, 8, 7, 6]


def prune_cfg(sparse_ratio=None, row_ratio=None, method="l1", related=True, quant_bits=None):
    block = {}
    if sparse_ratio:
        block["sparse_pruning"] = {
            "shared_parameters": {"enabled": True, "method": method, "schedule_offset": 0},
            "different_groups": {"sp": {"params": {"dense_ratio": sparse_ratio}, "modules": ["attn"]}},
        }
    if row_ratio:
        group = {"params": {"dense_ratio": row_ratio}, "modules": [r"mlp\.fc"]}
        if related:
            group["related_modules"] = [[r"mlp\.proj"]]
        block["row_pruning"] = {
            "shared_parameters": {"enabled": True, "method": method, "schedule_offset": 0},
            "different_groups": {"rp": group},
        }
    if quant_bits:
        block["weight_quantization"] = wq_cfg(quant_bits, quant_bits, modules=("blocks",))["compression_training"][
            "weight_quantization"
        ]
    return {"compression_training": block}


def test_gpt_sparse_mask_applied():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    init_compression(model, prune_cfg(sparse_ratio=0.5))
    layer = model.blocks[0].attn.qkv
    weight, _ = layer.effective_weight_and_bias()
    assert (weight == 0).float().mean().item() == pytest.approx(0.5, abs=1e-3)
    assert torch.equal(weight != 0, sparse_l1_mask(layer.weight, 0.5) > 0)


@pytest.mark.parametrize("quant_bits", [None, 8])
@pytest.mark.parametrize("method", ["l1", "topk"])
def test_redundancy_clean_matches_masked_model_and_shrinks(quant_bits, method):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    cfg = prune_cfg(sparse_ratio=0.5, row_ratio=0.5, method=method, quant_bits=quant_bits)
    init_compression(model, cfg)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        masked = model(idx)
    before, _ = state_bytes(model)
    fc_params = model.blocks[0].mlp.fc.weight.numel()
    redundancy_clean(model, cfg)
    with torch.no_grad():
        clean = model(idx)
    assert (clean - masked).abs().max().item() <= 1e-5
    fc, proj = model.blocks[0].mlp.fc, model.blocks[0].mlp.proj
    assert (fc.out_features, proj.in_features) == (128, 128)
    after, _ = state_bytes(model)
    assert not any(isinstance(m, LinearLayer_Compress) for m in model.modules())
    if quant_bits:
        assert isinstance(fc, QuantizedLinear) and fc.weight_codes.dtype == torch.int8
    else:
        # mask scores (topk) / mask buffers (l1) are gone and fc/proj lost half their rows/columns
        assert before - after >= 2 * (fc_params // 2) * 4 * 2
    assert after < before


def test_int8_storage_is_about_4x_smaller():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False))
    cfg = wq_cfg(modules=("0", "2"))
    before, _ = state_bytes(model)
    init_compression(model, cfg)
    x = torch.randn(3, 256)
    with torch.no_grad():
        qat = model(x)
    redundancy_clean(model, cfg)
    after, _ = state_bytes(model)
    with torch.no_grad():
        assert (model(x) - qat).abs().max().item() <= 1e-6
    assert before / after == pytest.approx(4.0, rel=0.02)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_nibble_packing_is_lossless(symmetric):
    from zerospeed.compression.basic_layer import pack_codes, unpack_codes

    lo, hi = (-8, 7) if symmetric else (0, 15)
    codes = torch.arange(lo, hi + 1).repeat(3, 1)[:, :15]  # every value, an odd column count
    packed = pack_codes(codes, 4, symmetric)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_codes(packed, 15, 4, symmetric), codes.to(torch.int16))
    # low nibble first: the first byte holds codes 0 and 1
    assert packed[0, 0].item() == (codes[0, 0] - lo) | ((codes[0, 1] - lo) << 4)


@pytest.mark.parametrize("width, values", [(2, [-1, 0, 1]), (1, [-1, 1])])
def test_ternary_and_binary_packing_is_lossless(width, values):
    from zerospeed.compression.basic_layer import pack_codes, unpack_codes

    g = torch.Generator().manual_seed(0)
    codes = torch.tensor(values)[torch.randint(0, len(values), (4, 13), generator=g)]
    packed = pack_codes(codes, width, True)
    assert packed.shape == (4, -(-13 // (8 // width)))
    assert torch.equal(unpack_codes(packed, 13, width, True), codes.to(torch.int16))
    first = [(c + 1) // 2 if width == 1 else c + 2 for c in codes[0, : 8 // width].tolist()]
    assert packed[0, 0].item() == sum(v << (i * width) for i, v in enumerate(first))


@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
def test_int4_storage_is_about_8x_smaller_and_survives_row_pruning(qtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 255, bias=False))
    cfg = wq_cfg(start=4, target=4, modules=("0", "2"), qtype=qtype)
    before, _ = state_bytes(model)
    init_compression(model, cfg)
    x = torch.randn(3, 256)
    with torch.no_grad():
        qat = model(x)
    redundancy_clean(model, cfg)
    after, _ = state_bytes(model)
    with torch.no_grad():
        assert (model(x) - qat).abs().max().item() <= 1e-5
    assert model[0].packed and model[0].weight_codes.shape == (256, 128)
    rows, weights = 256 + 255, 256 * 256 + 255 * 256
    per_row = 4 if qtype == "symmetric" else 8  # an fp32 scale per row; asymmetric: an fp32 zero point too
    expected = 4 * weights / (weights / 2 + per_row * rows)  # 7.88 / 7.53: ~8x less the scales
    assert before / after == pytest.approx(expected, rel=0.02)
    model[2].keep_cols(torch.arange(0, 256, 2))  # columns out of packed codes: unpacked, cut, repacked
    assert model[2].in_features == 128 and model[2].weight_codes.shape == (255, 64)


def test_layer_reduction_initialises_the_student_from_chosen_teacher_layers():
    """layer_reduction 4 -> 2: student block i = teacher block teacher_layer[i], embeddings and final norm
    copied; the student then computes exactly the teacher with blocks 0 and 2 dropped."""
    torch.manual_seed(0)
    teacher = GPT(GPTConfig(n_layer=4))
    torch.manual_seed(1)
    student = GPT(GPTConfig(n_layer=2))
    cfg = {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": 2,
                "module_name_prefix": "blocks",
                "teacher_layer": [1, 3],
                "other_module_name": ["wte", "wpe", "ln_f"],
            }
        }
    }
    student_initialization(student, teacher, cfg)
    for i, t in enumerate([1, 3]):
        for (n, a), (_, b) in zip(student.blocks[i].state_dict().items(), teacher.blocks[t].state_dict().items()):
            assert torch.equal(a, b), n
    assert torch.equal(student.wte.weight, teacher.wte.weight) and student.lm_head.weight is student.wte.weight
    ids = torch.randint(0, GPTConfig().vocab_size, (2, 8))
    with torch.no_grad():
        x = teacher.wte(ids) + teacher.wpe(torch.arange(8))
        for t in (1, 3):
            x = teacher.blocks[t](x)
        expected = teacher.lm_head(teacher.ln_f(x))
        assert torch.allclose(student(ids), expected, atol=1e-6)
    bad = {
        "compression_training": {
            "layer_reduction": {**cfg["compression_training"]["layer_reduction"], "keep_number_layer": 3}
        }
    }
    with pytest.raises(ConfigError, match="keep_number_layer: 3 != len"):
        student_initialization(student, teacher, bad)


# -- XTC: ternary and binary weights -------------------------------------------------------------
def test_ternary_hand_values():
    w = torch.tensor([[0.1, -1.0, 0.5, 2.0, -0.2, 0.2]])  # mean|w| = 4/6, threshold 0.7 * 4/6 = 0.4667
    c = quantize_codes(w, 2)
    assert c.codes.tolist() == [[0.0, -1.0, 1.0, 1.0, 0.0, 0.0]]
    assert c.scale.item() == pytest.approx((1.0 + 0.5 + 2.0) / 3)  # mean |w| of the kept
    torch.testing.assert_close(fake_quantize(w, 2), torch.tensor([[0.0, -7 / 6, 7 / 6, 7 / 6, 0.0, 0.0]]))


def test_binary_hand_values_per_group():
    w = torch.tensor([[1.0, -3.0], [0.0, -0.5]])
    torch.testing.assert_close(fake_quantize(w, 1, groups=2), torch.tensor([[2.0, -2.0], [0.25, -0.25]]))


def test_extreme_bits_must_be_symmetric():
    with pytest.raises(ConfigError, match=r"weight_quantization: expected shared_parameters\.quantization_type"):
        parse_compression_config(wq_cfg(start=2, target=2, qtype="asymmetric"))


@pytest.mark.parametrize("bits, ratio", [(2, 16), (1, 32)])
def test_ternary_and_binary_layers_store_2_and_1_bit_codes(bits, ratio):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False))
    cfg = wq_cfg(start=bits, target=bits, modules=("0", "2"))
    before, _ = state_bytes(model)
    init_compression(model, cfg)
    x = torch.randn(3, 256)
    w = model[0].weight.detach().clone()
    with torch.no_grad():
        qat = model(x)
        by_hand = fake_quantize(w, bits)  # one group: the whole matrix shares alpha
        assert len(torch.unique(model[0].effective_weight_and_bias()[0])) == bits + 1
        torch.testing.assert_close(model[0].effective_weight_and_bias()[0], by_hand)
    redundancy_clean(model, cfg)
    after, _ = state_bytes(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), qat, atol=1e-5, rtol=0)
    assert model[0].width == bits and model[0].weight_codes.shape == (256, 256 * bits // 8)
    weights, rows = 2 * 256 * 256, 2 * 256
    assert before / after == pytest.approx(4 * weights / (weights * bits / 8 + 4 * rows), rel=0.02)
    assert before / after > ratio * 0.8
