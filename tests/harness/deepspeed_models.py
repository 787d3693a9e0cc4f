"""Models from DeepSpeed's own unit tests, rebuilt here for the tests that check DeepSpeed's behaviours."""

from __future__ import annotations

import torch


class SubModel(torch.nn.Module):
    def __init__(self, n_in, n_out, device=None):
        super().__init__()
        self.linear = torch.nn.Linear(n_in, n_out, device=device)
        self.module_list = torch.nn.ModuleList([torch.nn.Linear(n_in, n_out, device=device)])

    def forward(self, x):
        return self.module_list[0](self.linear(x))


class SkipInitModel(torch.nn.Module):
    """DeepSpeed's TestParamPartitioningSkipInit model (tests/unit/v1/zero/test_zero.py)."""

    def __init__(self, hidden=10):
        super().__init__()
        self.l1 = torch.nn.utils.skip_init(torch.nn.Linear, hidden, hidden)
        self.l2 = torch.nn.utils.skip_init(SubModel, hidden, hidden)
        self.l3 = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.l3(self.l2(self.l1(x))).pow(2).mean()
