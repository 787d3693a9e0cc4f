"""Compressed model files: what ``redundancy_clean`` made is saved, really smaller on disk, and loads back
into a freshly built model that computes exactly the same outputs."""

import copy

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

from zerospeed.compression import init_compression, redundancy_clean
from zerospeed.compression.basic_layer import QuantizedLinear
from zerospeed.compression.storage import load_compressed, save_compressed
from zoo.models import GPT, GPTConfig

GPT_CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=16)


def block(*techniques):
    out = {}
    for name, params, modules, extra in techniques:
        group = {"params": params, "modules": modules, **extra.pop("group", {})}
        out[name] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, **extra},
            "different_groups": {"g": group},
        }
    return {"compression_training": out}


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_quantized_gpt_file_shrinks_and_loads_back(tmp_path, bits):
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    fp32 = tmp_path / "fp32.safetensors"
    save_model(model, str(fp32))
    cfg = block(
        ("weight_quantization", {"start_bits": bits, "target_bits": bits}, ["blocks"], {}),
        (
            "row_pruning",
            {"dense_ratio": 0.5},
            [r"mlp\.fc"],
            {"method": "l1", "group": {"related_modules": [[r"mlp\.proj"]]}},
        ),
        ("activation_quantization", {"bits": 8}, [r"attn\.qkv"], {"range_calibration": "static"}),
    )
    init_compression(model, cfg)
    model(torch.randint(0, 256, (2, 16)))  # a training-mode forward sets the static activation ranges
    redundancy_clean(model, cfg)
    model.eval()
    path = tmp_path / "compressed.safetensors"
    size = save_compressed(model, path)
    assert size == path.stat().st_size
    torch.manual_seed(1)
    rebuilt = load_compressed(GPT(GPT_CFG), path)  # other initial weights: everything comes from the file
    x = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        assert torch.equal(rebuilt(x), model(x))
    assert isinstance(rebuilt.blocks[0].mlp.fc, QuantizedLinear) and rebuilt.blocks[0].mlp.fc.out_features == 128
    assert rebuilt.lm_head.weight is rebuilt.wte.weight  # the tie survives
    # the block Linears hold 2 x (3 + 1 + 2) x 64 x 64 weights (mlp.fc / mlp.proj halved by row pruning);
    # embeddings and norms stay fp32
    block_weights = 2 * (3 * 64 * 64 + 64 * 64 + 2 * 4 * 64 * 64)
    kept = 2 * (3 * 64 * 64 + 64 * 64 + 2 * 2 * 64 * 64)
    saved = block_weights * 4 - kept * bits / 8
    assert fp32.stat().st_size - size == pytest.approx(saved, rel=0.03)


def test_channel_pruned_convnet_round_trip(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    net.train()
    net(torch.randn(4, 3, 6, 6))
    net.eval()
    cfg = block(("channel_pruning", {"dense_ratio": 0.25}, [r"^0$"], {"group": {"related_modules": [["^1$", "^3$"]]}}))
    init_compression(net, cfg)
    redundancy_clean(net, cfg)
    path = tmp_path / "net.safetensors"
    save_compressed(net, path)
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    load_compressed(fresh, path)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert torch.equal(fresh(x), net(x))
    assert fresh[0].out_channels == 2 and fresh[1].num_features == 2 and fresh[3].in_channels == 2


def test_saving_before_redundancy_clean_and_loading_a_plain_file_are_errors(tmp_path):
    model = GPT(GPT_CFG)
    plain = tmp_path / "plain.safetensors"
    save_model(model, str(plain))
    with pytest.raises(ValueError, match="not a zerospeed compressed model file"):
        load_compressed(copy.deepcopy(model), plain)
    init_compression(model, block(("row_pruning", {"dense_ratio": 0.5}, [r"mlp\.fc"], {})))
    with pytest.raises(ValueError, match="call redundancy_clean"):
        save_compressed(model, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
