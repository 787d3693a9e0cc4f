"""Distillation: the soft-target loss against hand values, and ZeroQuant's layer-by-layer distillation
(a 4-bit student's layers move towards the fp32 teacher's, layer by layer, and nothing else moves)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from zerospeed.compression import init_compression
from zerospeed.compression.distill import distillation_loss, layerwise_distill
from zoo.models import GPT, GPTConfig


def test_distillation_loss_hand_values():
    s = torch.tensor([[0.0, 0.0]], requires_grad=True)
    t = torch.tensor([[math.log(3.0), 0.0]])  # softmax: 0.75 / 0.25
    want = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert distillation_loss(s, t).item() == pytest.approx(want, rel=1e-6)
    # T = 2: the teacher's softmax of log(3)/2 = log(sqrt 3): sqrt3 / (1 + sqrt3); times T**2
    p = math.sqrt(3) / (1 + math.sqrt(3))
    want2 = 4 * (p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5))
    # (the loss is computed in float32: the two KL terms partly cancel, so their rounding reached 1.2e-6
    # relative on one CPU; 5e-6 is ~80 float32 ulps)
    assert distillation_loss(s, t, temperature=2.0).item() == pytest.approx(want2, rel=5e-6)
    distillation_loss(s, t).backward()
    assert s.grad is not None  # the teacher is a constant: only the student gets a gradient
    assert distillation_loss(t, t).item() == pytest.approx(0.0, abs=1e-7)


def test_distillation_loss_averages_over_positions():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    per_position = [distillation_loss(s[i, j : j + 1], t[i, j : j + 1]).item() for i in range(2) for j in range(3)]
    assert distillation_loss(s, t).item() == pytest.approx(sum(per_position) / 6, rel=1e-5)


def _layer_mse(student, teacher, x):
    """Per block: the MSE between the student's and the teacher's block on the teacher's hidden state."""
    out = []
    with torch.no_grad():
        h = teacher.wte(x) + teacher.wpe(torch.arange(x.shape[1]))
        for s_block, t_block in zip(student.blocks, teacher.blocks):
            out.append(F.mse_loss(s_block(h), t_block(h)).item())
            h = t_block(h)
    return out


def test_layerwise_distillation_moves_each_quantized_layer_towards_the_teacher():
    torch.manual_seed(0)
    teacher = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16)).eval()
    student = copy.deepcopy(teacher)
    init_compression(
        student,
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "schedule_offset": 0},
                    "different_groups": {"w4": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["blocks"]}},
                }
            }
        },
    )
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 16), generator=g) for _ in range(4)]
    held_out = torch.randint(0, 256, (4, 16), generator=g)
    before = _layer_mse(student, teacher, held_out)
    with torch.no_grad():
        whole_before = F.mse_loss(student(held_out), teacher(held_out)).item()
    embeddings = student.wte.weight.detach().clone()
    final = layerwise_distill(student, teacher, "blocks", batches, steps_per_layer=30, lr=1e-3)
    after = _layer_mse(student, teacher, held_out)
    assert len(final) == 3
    assert all(a < 0.85 * b for a, b in zip(after, before)), (before, after)
    assert torch.equal(student.wte.weight, embeddings)  # only the blocks were trained
    with torch.no_grad():
        assert F.mse_loss(student(held_out), teacher(held_out)).item() < 0.8 * whole_before


def test_layerwise_distill_needs_matching_layers():
    teacher = GPT(GPTConfig(n_layer=2))
    student = GPT(GPTConfig(n_layer=1))
    with pytest.raises(ValueError, match="1 student layers and 2 teacher layers"):
        layerwise_distill(student, teacher, "blocks", [torch.zeros(1, 4, dtype=torch.long)], 1)
