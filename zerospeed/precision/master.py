"""fp32 master copies of low-precision parameters.

With bf16/fp16 the model holds low-precision parameters for compute while the optimizer updates fp32
masters (its states are fp32 too); after each step the masters are written back to the model.
In fp32 the "master" of a parameter is the parameter itself and nothing is copied.
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter], mixed: bool):
        self.model_params = params
        self.mixed = mixed
        if mixed:
            self.masters = [
                torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad) for p in params
            ]
        else:
            self.masters = list(params)
        self._master_of = {id(p): m for p, m in zip(params, self.masters)}

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        return self._master_of[id(param)]

    def map_param_groups(self, model_parameters):
        """The user's `model_parameters` (tensors or param-group dicts) with masters substituted."""
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [{**g, "params": [self._master_of.get(id(p), p) for p in g["params"]]} for g in items]
        return [self._master_of.get(id(p), p) for p in items]

    def retarget_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point a client optimizer built on model parameters at the masters instead."""
        for group in optimizer.param_groups:
            group["params"] = [self._master_of.get(id(p), p) for p in group["params"]]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.mixed:
            torch._foreach_copy_(self.model_params, self.masters)
