"""The tensor census counts each storage once, whatever views and parameters share it."""

import torch

from harness import live_tensor_bytes


def test_census_counts_new_storage_exactly_once():
    before = live_tensor_bytes("cpu")
    big = torch.zeros(1024, 256)  # 1 MiB
    view = big[:10]
    param = torch.nn.Parameter(big)  # shares storage
    after = live_tensor_bytes("cpu")
    assert after - before == 1024 * 256 * 4
    del big, view, param
    assert live_tensor_bytes("cpu") == before
