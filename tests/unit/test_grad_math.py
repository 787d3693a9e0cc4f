"""Exact values of the gradient arithmetic used at the optimizer step."""

import math

import torch

from harness import split_global_batch
from zerospeed.zero.grad_math import clip_coefficient, global_norm, reduction_factors


def test_global_norm_over_tensors():
    assert global_norm([torch.tensor([3.0]), torch.tensor([[4.0, 0.0]])]) == 5.0
    assert global_norm([]) == 0.0
    assert math.isinf(global_norm([torch.tensor([1.0, float("inf")])]))


def test_clip_coefficient_matches_torch_rule():
    assert clip_coefficient(10.0, 1.0) == 1.0 / (10.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(10.0, 0.0) == 1.0  # 0 disables clipping
    g = torch.tensor([6.0, 8.0])
    torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0)  # sanity: api exists
    assert torch.allclose(g * clip_coefficient(10.0, 1.0), torch.tensor([0.6, 0.8]), atol=1e-6)


def test_reduction_factors_follow_deepspeed_rules():
    assert reduction_factors(4, "avg", prescale=False, predivide_factor=1.0) == (1.0, 0.25)
    assert reduction_factors(4, "avg", prescale=False, predivide_factor=2.0) == (0.5, 0.5)
    assert reduction_factors(4, "avg", prescale=True, predivide_factor=2.0) == (0.25, 1.0)
    assert reduction_factors(4, "sum", prescale=False, predivide_factor=2.0) == (1.0, 1.0)


def test_split_global_batch_interleaves_ranks_per_micro_step():
    x = torch.arange(8)
    assert [m[0].tolist() for m in split_global_batch((x,), 2, 2, rank=0)] == [[0, 1], [4, 5]]
    assert [m[0].tolist() for m in split_global_batch((x,), 2, 2, rank=1)] == [[2, 3], [6, 7]]
