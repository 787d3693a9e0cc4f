"""The ZeRO-3 leaf-module API (DeepSpeed's `deepspeed.utils.set_z3_leaf_modules` family) and the
granularity rule of `stage3_module_granularity_threshold`, checked against counts worked out by hand."""

import sys

import pytest
from torch import nn

import zerospeed.utils as zutils
from zerospeed.config import ZeroSpeedConfig
from zerospeed.zero.leaf_modules import (
    apply_leaf_module_config,
    module_granularity,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    set_z3_leaf_modules_by_threshold,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)  # 272
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))  # 544 + 528
        self.norm = nn.LayerNorm(16)  # 32


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4)  # 68
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))  # 4 x 272


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)  # 1600
        self.blocks = nn.ModuleList([Block(), Block()])
        self.moe = Experts()
        self.head = nn.Linear(16, 3)  # 51


def test_granularity_is_subtree_parameters_over_layers_by_hand():
    net = Net()
    g = module_granularity(net)
    # a block: 1376 parameters; layers = itself + attn + the two linears (the Sequential passes them
    # through, the GELU holds nothing) + norm = 5
    assert g[id(net.blocks[0])] == 1376 // 5 == 275
    # the MoE block: 68 + 1088 = 1156 parameters over itself + gate + 4 experts = 6 layers
    assert g[id(net.moe)] == 1156 // 6 == 192
    # the whole model: 1600 + 2 * 1376 + 1156 + 51 = 5559 over 1 + 1 + 2 * 5 + 6 + 1 = 19 layers
    assert g[id(net)] == 5559 // 19 == 292
    # childless modules and containers never qualify
    for m in (net.emb, net.head, net.blocks, net.blocks[0].mlp, net.moe.experts, net.blocks[0].attn):
        assert g[id(m)] == sys.maxsize


def test_threshold_flags_the_outermost_modules_at_or_below_it():
    net = Net()
    assert set_z3_leaf_modules_by_threshold(net, 280) == [net.blocks[0], net.blocks[1], net.moe]
    assert zutils.get_z3_leaf_modules(net) == [net.blocks[0], net.blocks[1], net.moe]
    net = Net()
    assert set_z3_leaf_modules_by_threshold(net, 200) == [net.moe]  # the blocks (275) are above it
    net = Net()
    assert set_z3_leaf_modules_by_threshold(net, 292) == [net]  # the root qualifies first: nothing below is visited
    net = Net()
    assert set_z3_leaf_modules_by_threshold(net, 191) == []
    assert set_z3_leaf_modules_by_threshold(net, 0) == [] and zutils.get_z3_leaf_modules(net) == []


def test_set_and_unset_by_class_object_short_and_qualified_name():
    net = Net()
    assert zutils.set_z3_leaf_modules(net, [Block]) == list(net.blocks)
    assert zutils.z3_leaf_module(net.blocks[1]) and not zutils.z3_leaf_module(net.moe)
    assert zutils.set_z3_leaf_modules(net, ["Experts"]) == [net.moe]
    assert zutils.unset_z3_leaf_modules(net, [f"{Block.__module__}.Block"]) == list(net.blocks)
    assert zutils.get_z3_leaf_modules(net) == [net.moe]
    zutils.set_z3_leaf_module(net.moe, False)
    assert zutils.get_z3_leaf_modules(net) == []
    with pytest.raises(ValueError, match="no module of class"):
        zutils.set_z3_leaf_modules(net, ["MixtralSparseMoeBlock"])
    assert zutils.set_z3_leaf_modules(net, ["MixtralSparseMoeBlock"], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="module classes or their names"):
        zutils.set_z3_leaf_modules(net, [3])


def test_by_name_and_suffix_return_the_misses():
    net = Net()
    found, missing = set_z3_leaf_modules_by_name(net, ["blocks.1", "nope"], raise_if_not_found=False)
    assert found == [net.blocks[1]] and missing == ["nope"]
    with pytest.raises(ValueError, match=r"no module named \['nope'\]"):
        set_z3_leaf_modules_by_name(net, ["nope"])
    found, missing = set_z3_leaf_modules_by_suffix(net, ["mlp", "xyz"], raise_if_not_found=False)
    assert found == [net.blocks[0].mlp, net.blocks[1].mlp] and missing == ["xyz"]
    found, _ = set_z3_leaf_modules_by_suffix(net, ["mlp"], flag=False)
    assert not any(zutils.z3_leaf_module(m) for m in found)


def test_leaf_module_config_keys():
    cfg = ZeroSpeedConfig.model_validate(
        {
            "train_batch_size": 1,
            "zero_optimization": {
                "stage": 3,
                "leaf_module": {"classes": ["Experts"], "names": ["blocks.0"], "name_suffixes": ["head"]},
            },
        }
    )
    net = Net()
    flagged = apply_leaf_module_config(net, cfg.zero_optimization.leaf_module)
    assert {id(m) for m in flagged} == {id(net.moe), id(net.blocks[0]), id(net.head)}
    # the default class list (transformers' MoE blocks) matches nothing here and flags nothing
    default = ZeroSpeedConfig.model_validate({"train_batch_size": 1, "zero_optimization": {"stage": 3}})
    assert apply_leaf_module_config(Net(), default.zero_optimization.leaf_module) == []
