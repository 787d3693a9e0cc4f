"""ZeRO stage 0 as a strategy: replicated optimizer, bucketed gradient all-reduce (plain data parallel)."""
from __future__ import annotations

import torch

from zerospeed.precision.master import MasterWeights
from zerospeed.runtime.data_parallel import GradientAllReducer
from zerospeed.runtime.grad_math import global_norm
from zerospeed.zero.optimizer_step import InMemoryStepper, step_in_sub_groups
from zerospeed.zero.sharded import optimizer_state_bytes
from zerospeed.zero.shards import Piece, ShardEntry


class DataParallelStrategy:
    stage = 0

    def __init__(self, groups: list[dict], *, mixed: bool, **reducer_kwargs):
        self.groups = groups
        params = [p for g in groups for p in g["params"]]
        self.master = MasterWeights(params, mixed=mixed)
        self.reducer = GradientAllReducer(params, **reducer_kwargs)

    def optimizer_param_groups(self) -> list[dict]:
        return self.master.map_param_groups(self.groups)

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        self.master.retarget_optimizer(optimizer)

    def begin_backward(self, sync: bool) -> None:
        self.reducer.begin_backward(sync)

    def start_micro_step(self) -> None:
        pass

    def end_micro_step(self) -> None:
        pass

    def finish_reduction(self) -> None:
        self.reducer.finish()

    def global_grad_norm(self) -> float:
        # The buffers already hold the all-reduced gradient: the local norm is the global one.
        return global_norm(self.reducer.buffers())

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        # (the gradient views partition the bucket buffers, so scaling them scales every buffer)
        step_in_sub_groups(optimizer, [(self.master.master_of(p), g) for p, g in self.reducer.grads()], coef)
        self.master.copy_to_model()

    def zero_grads(self) -> None:
        self.reducer.zero()

    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        """Every master is a whole parameter, held identically by every rank."""
        return [ShardEntry(m, [Piece(names[id(p)], 0, 0, p.numel())])
                for p, m in zip(self.master.model_params, self.master.masters)]

    def sync_params_from_masters(self) -> None:
        self.master.copy_to_model()

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        if self.master.mixed:
            torch._foreach_copy_(self.master.masters, self.master.model_params)

    def resident(self, optimizer):
        """Masters and optimizer states are always in memory at stage 0."""
        return InMemoryStepper().resident(optimizer)

    def placement(self) -> dict[str, str]:
        where = str(next((p.device for g in self.optimizer_param_groups() for p in g["params"]), "none"))
        return {"parameters": where, "gradients": where, "master_weights": where, "optimizer_states": where}

    def swap_files(self) -> list:
        return []

    def close(self) -> None:
        pass

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()

    def memory_breakdown(self, optimizer) -> dict[str, int]:
        params = sum(p.nbytes for p in self.master.model_params)
        masters = sum(m.nbytes for m in self.master.masters) if self.master.mixed else 0
        return {"parameters": params, "gradients": sum(b.nbytes for b in self.reducer.buffers()),
                "master_weights": masters, "optimizer_states": optimizer_state_bytes(optimizer)}
