"""Compression: activation quantization, head pruning and channel pruning, each against hand-computed
values or a model edited by hand in plain PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.compression import init_compression, parse_compression_config, redundancy_clean
from zerospeed.compression.basic_layer import Conv2dLayer_Compress, LinearLayer_Compress, QuantizedLinear
from zerospeed.compression.prune import channel_l1_mask, head_l1_mask
from zerospeed.compression.quantize import ActivationRange, ste_quantize_activation
from zerospeed.compression.scheduler import compression_scheduler
from zerospeed.utils.errors import ConfigError
from zoo.models import TinyMLP


def technique(name, params, modules, related=None, **shared):
    group = {"params": params, "modules": modules}
    if related:
        group["related_modules"] = related
    return {name: {"shared_parameters": {"enabled": True, **shared}, "different_groups": {"g": group}}}


def cfg(*blocks):
    out = {}
    for b in blocks:
        out.update(b)
    return {"compression_training": out}


# -- activation quantization: the quantizer ------------------------------------------------------
def test_dynamic_symmetric_is_per_token_hand_values():
    x = torch.tensor([[7.0, 2.4, -3.6], [-3.5, 1.3, 0.2]])
    # 4 bits: qmax 7. Token 0: scale 7/7 = 1, codes 7, 2, -4. Token 1: scale 3.5/7 = 0.5, codes -7, 3, 0.
    want = torch.tensor([[7.0, 2.0, -4.0], [-3.5, 1.5, 0.0]])
    torch.testing.assert_close(ste_quantize_activation(x, 4), want, atol=1e-6, rtol=0)


def test_dynamic_asymmetric_hand_values():
    x = torch.tensor([[0.0, 1.0, 3.0, 0.5]])  # 4 bits: scale 3/15 = 0.2, zero 0; 0.5 -> round(2.5) = 2
    torch.testing.assert_close(
        ste_quantize_activation(x, 4, symmetric=False), torch.tensor([[0.0, 1.0, 3.0, 0.4]]), atol=1e-6, rtol=0
    )


def test_static_range_clamps_and_sample_wise_groups_whole_samples():
    x = torch.tensor([[0.25, -3.0, 1.0]])
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)  # 8 bits symmetric over [-1, 1]: scale 1/127
    out = ste_quantize_activation(x, 8, x_range=(lo, hi))
    torch.testing.assert_close(out, torch.tensor([[32 / 127, -1.0, 1.0]]), atol=1e-6, rtol=0)
    img = torch.tensor([[[[7.0, -2.2]]], [[[1.4, 3.5]]]])  # two samples, each its own range: scales 1 and 0.5
    got = ste_quantize_activation(img, 4, sample_wise=True)
    torch.testing.assert_close(got, torch.tensor([[[[7.0, -2.0]]], [[[1.5, 3.5]]]]), atol=1e-6, rtol=0)


def test_activation_range_is_deepspeeds_moving_average_frozen_in_eval():
    r = ActivationRange()
    r(torch.tensor([-1.0, 2.0]))
    assert r.x_min_max.tolist() == [-1.0, 2.0]  # the first batch sets it
    r(torch.tensor([-3.0, 4.0]))
    torch.testing.assert_close(r.x_min_max, torch.tensor([0.95 * -1 + 0.05 * -3, 0.95 * 2 + 0.05 * 4]))
    frozen = r.x_min_max.clone()
    r.eval()
    r(torch.tensor([-100.0, 100.0]))
    assert torch.equal(r.x_min_max, frozen)
    assert "x_min_max" in r.state_dict()


def test_activation_quantization_gradient_is_straight_through():
    x = torch.randn(3, 5, requires_grad=True)
    (ste_quantize_activation(x, 4) * torch.arange(5.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(5.0).expand(3, 5))


# -- activation quantization: the layer and its schedule -----------------------------------------
@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_linear_quantizes_its_input_from_the_offset(calibration):
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    init_compression(
        model,
        cfg(
            technique(
                "activation_quantization", {"bits": 8}, [r"net\.0"], schedule_offset=2, range_calibration=calibration
            )
        ),
    )
    layer, ref = model.net[0], plain.net[0]
    schedule = compression_scheduler(model)
    x = torch.randn(4, ref.in_features)
    for step in range(4):
        got = layer(x)
        if step < 2:
            want = ref(x)
        else:
            flat = x
            lo, hi = (
                (flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True))
                if calibration == "dynamic"
                else (layer.activation_range.x_min_max[0], layer.activation_range.x_min_max[1])
            )
            scale = torch.maximum(lo.abs(), hi.abs()) / 127
            want = F.linear(torch.round(x / scale).clamp(-127, 127) * scale, ref.weight, ref.bias)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        schedule.step()


def test_bad_activation_bits_name_the_key():
    block = cfg(technique("activation_quantization", {"bits": 6}, ["net"]))
    with pytest.raises(ConfigError, match=r"activation_quantization\.different_groups\.g\.params\.bits"):
        parse_compression_config(block)


# -- head pruning --------------------------------------------------------------------------------
def test_head_l1_mask_hand_values():
    w = torch.zeros(2, 8)  # 4 heads of 2 columns; head L1 norms 1, 5, 2, 4
    w[0, 0:2] = 0.5
    w[1, 2:4] = torch.tensor([2.0, 3.0])
    w[0, 4] = 2.0
    w[1, 6:8] = torch.tensor([-1.0, 3.0])
    assert head_l1_mask(w, 4, 0.5).tolist() == [[0.0, 1.0, 0.0, 1.0]]


class Attention(nn.Module):
    """Multi-head self-attention with separate q / k / v / o projections; the head count follows
    the projections' width, as in transformers' Llama and BERT."""

    def __init__(self, d_model=16, n_head=4):
        super().__init__()
        self.head_dim = d_model // n_head
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x_BTD):
        B, T, _ = x_BTD.shape
        q, k, v = (
            p(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def head_cfg(method="l1", quant=False):
    blocks = [
        technique(
            "head_pruning",
            {"dense_ratio": 0.5},
            [r"o_proj"],
            [[r"q_proj", r"k_proj", r"v_proj"]],
            method=method,
            num_heads=4,
            schedule_offset=0,
        )
    ]
    if quant:
        blocks.append(technique("weight_quantization", {"start_bits": 8, "target_bits": 8}, [r"proj"]))
    return cfg(*blocks)


def zero_heads_by_hand(model: TwoLayers) -> TwoLayers:
    """The reference: the original model with the o_proj columns of each layer's two weakest heads
    (by the L1 norm of their columns, computed here) set to zero."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.layers:
            norms = layer.o_proj.weight.abs().reshape(16, 4, 4).sum(dim=(0, 2))
            for h in torch.argsort(norms)[:2].tolist():
                layer.o_proj.weight[:, h * 4 : (h + 1) * 4] = 0
    return ref


@pytest.mark.parametrize("quant", [False, True])
def test_head_pruning_masks_then_removes_heads(quant):
    torch.manual_seed(0)
    model = TwoLayers()
    ref = zero_heads_by_hand(model)
    config = head_cfg(quant=quant)
    init_compression(model, config)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        masked = model(x)
    if not quant:
        torch.testing.assert_close(masked, ref(x), atol=1e-6, rtol=0)
    redundancy_clean(model, config)
    with torch.no_grad():
        clean = model(x)
    torch.testing.assert_close(clean, masked, atol=1e-5, rtol=0)
    for layer in model.layers:
        o = layer.o_proj
        assert (o.in_features, o.out_features) == (8, 16)
        assert all(p.out_features == 8 and p.in_features == 16 for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        assert isinstance(o, QuantizedLinear) == quant
    if not quant:  # 2 heads x 4 dims gone from q, k, v (rows and bias) and from o (columns), per layer
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) - 2 * (
            3 * 8 * (16 + 1) + 16 * 8
        )


def test_topk_head_scores_learn_through_the_mask():
    torch.manual_seed(0)
    model = TwoLayers()
    init_compression(model, head_cfg(method="topk"))
    o = model.layers[0].o_proj
    assert o.head_mask_scores.shape == (1, 4)
    model(torch.randn(2, 5, 16)).sum().backward()
    assert o.head_mask_scores.grad is not None and o.head_mask_scores.grad.abs().sum() > 0


def test_head_pruning_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"head_pruning: expected shared_parameters\.num_heads"):
        parse_compression_config(cfg(technique("head_pruning", {"dense_ratio": 0.5}, ["o_proj"])))
    with pytest.raises(ConfigError, match=r"head_pruning\.shared_parameters\.num_heads: 3 does not divide"):
        init_compression(TwoLayers(), cfg(technique("head_pruning", {"dense_ratio": 0.5}, ["o_proj"], num_heads=3)))


def test_head_pruning_of_a_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ref = copy.deepcopy(model)
    with torch.no_grad():  # by hand: zero the o_proj columns of each layer's two weakest heads
        for layer in ref.model.layers:
            w = layer.self_attn.o_proj.weight
            for h in torch.argsort(w.abs().reshape(32, 4, 8).sum(dim=(0, 2)))[:2].tolist():
                w[:, h * 8 : (h + 1) * 8] = 0
    block = cfg(
        technique(
            "head_pruning",
            {"dense_ratio": 0.5},
            [r"o_proj"],
            [[r"q_proj", r"k_proj", r"v_proj"]],
            method="l1",
            num_heads=4,
            schedule_offset=0,
        )
    )
    init_compression(model, block)
    redundancy_clean(model, block)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    assert model.model.layers[0].self_attn.q_proj.out_features == 16


# -- channel pruning -----------------------------------------------------------------------------
def test_channel_l1_mask_hand_values():
    w = torch.zeros(3, 1, 2, 2)
    w[0] = 1.0  # L1 4
    w[1, 0, 0, 0] = -5.0  # L1 5
    w[2, 0, 1] = 0.5  # L1 1
    assert channel_l1_mask(w, 0.66).view(-1).tolist() == [1.0, 1.0, 0.0]


class ConvNet(nn.Module):
    def __init__(self, bn: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.conv2(F.relu(self.bn1(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("bn", [False, True])
def test_channel_pruning_removes_channels_like_a_hand_edited_model(bn):
    torch.manual_seed(0)
    model = ConvNet(bn)
    if bn:  # non-trivial running statistics
        model.train()
        model(torch.randn(8, 3, 6, 6))
    model.eval()
    keep = channel_l1_mask(model.conv1.weight, 0.5).view(-1) > 0
    ref = copy.deepcopy(model)
    with torch.no_grad():  # by hand: the pruned channels give 0 after conv1 (and after the BatchNorm)
        ref.conv1.weight[~keep] = 0
        ref.conv1.bias[~keep] = 0
        if bn:
            ref.bn1.weight[~keep] = 0
            ref.bn1.bias[~keep] = 0
    related = [[r"conv2", r"bn1"]] if bn else [[r"conv2"]]
    block = cfg(technique("channel_pruning", {"dense_ratio": 0.5}, [r"conv1"], related, schedule_offset=0))
    init_compression(model, block)
    assert isinstance(model.conv1, Conv2dLayer_Compress)
    redundancy_clean(model, block)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=0)
    assert type(model.conv1) is nn.Conv2d and model.conv1.out_channels == 4 and model.conv2.in_channels == 4
    assert tuple(model.conv2.weight.shape) == (4, 4, 3, 3)
    if bn:
        assert model.bn1.num_features == 4
        assert torch.equal(model.bn1.running_mean, ref.bn1.running_mean[keep])


def test_channel_pruning_matches_only_convolutions():
    with pytest.raises(ConfigError, match=r"channel_pruning\.different_groups\.g\.modules: .* match no nn\.Conv2d"):
        init_compression(TinyMLP(), cfg(technique("channel_pruning", {"dense_ratio": 0.5}, ["net"])))


def test_related_module_of_the_wrong_size_is_an_error():
    model = ConvNet(bn=False)
    model.conv2 = nn.Conv2d(8, 4, 3, padding=1)
    model.other = nn.Conv2d(5, 4, 1)
    block = cfg(technique("channel_pruning", {"dense_ratio": 0.5}, [r"conv1"], [[r"other"]], schedule_offset=0))
    init_compression(model, block)
    with pytest.raises(ConfigError, match=r"related_modules: other has 5 inputs where conv1 had 8 outputs"):
        redundancy_clean(model, block)


def test_input_quantization_survives_redundancy_clean():
    torch.manual_seed(0)
    model = TinyMLP()
    block = cfg(
        technique("activation_quantization", {"bits": 4}, [r"net\.0"], schedule_offset=0),
        technique("weight_quantization", {"start_bits": 8, "target_bits": 8}, [r"net\.2"]),
    )
    init_compression(model, block)
    x = torch.randn(3, model.net[0].in_features)
    with torch.no_grad():
        before = model(x)
    redundancy_clean(model, block)
    assert isinstance(model.net[0], LinearLayer_Compress) and model.net[0].act_quant.bits == 4
    assert isinstance(model.net[2], QuantizedLinear)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_integer_matmul_equals_the_float_path(calibration):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 24))
    block = cfg(
        technique("weight_quantization", {"start_bits": 8, "target_bits": 8}, [r"^\d$"], quantize_groups=8),
        technique("activation_quantization", {"bits": 8}, [r"^\d$"], schedule_offset=0, range_calibration=calibration),
    )
    init_compression(model, block)
    model(torch.randn(16, 48))  # (a static range needs a training batch)
    redundancy_clean(model, block)
    model.eval()
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        float_path = model(x)
        for m in model:
            if isinstance(m, QuantizedLinear):
                m.integer_matmul = True
        assert all(m._w8a8() for m in model if isinstance(m, QuantizedLinear))
        int_path = model(x)
    assert int_path.shape == float_path.shape
    torch.testing.assert_close(int_path, float_path, atol=1e-5, rtol=1e-5)
