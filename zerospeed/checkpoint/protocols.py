"""What modules tell a checkpoint about parameters that are not whole on this rank.

The checkpoint sits below the packages that split parameters (parallel, moe), so it never imports
their classes: a module that holds experts or tensor-parallel pieces implements one of the small
protocols here, and the checkpoint asks every module of the model whether it does.

- `HoldsExperts` (DeepSpeed's `MoE`, AutoEP's expert containers): which of the layer's experts this
  rank holds and under which names (Note [global expert names] in experts.py).
- `SplitParameters`: a parameter of the module at full size (collective over the ranks that split it):
  AutoEP's stacked experts, gathered over their expert-parallel group.
- `TensorParallelLayer` (zerospeed.parallel.tensor's layers, AutoTP's replacements): also how each of
  its parameters is split over the tensor-parallel group (Note [canonical tensors] in tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from zerospeed.checkpoint.tensor_parallel import Layouts, TPLayout, is_identity


@dataclass(frozen=True)
class ExpertShare:
    """This rank's share of one layer's experts, as the layer describes it to a checkpoint."""

    first: int  # global index of this rank's expert 0
    local: int  # experts this rank holds
    writer: bool  # rank 0 of the experts' expert-data-parallel group: writes their files
    experts: str = ""  # the ModuleList of one module per expert, relative to the layer ("" when stacked)
    stacked: tuple[str, ...] = ()  # or: the [local, ...] parameters holding every local expert, relative names
    total: int = 0  # the layer's experts (stacked ones: the full tensors' first dimension)


@runtime_checkable
class HoldsExperts(Protocol):
    def checkpoint_experts(self) -> ExpertShare:
        """This rank's experts of the layer (not collective)."""
        ...


@runtime_checkable
class SplitParameters(Protocol):
    def full_parameter(self, name: str) -> torch.Tensor | None:
        """Collective over the ranks that split it: the full tensor of own parameter `name` (not recursive), in
        the layout of the model before it was split (a new tensor); None when it is whole on this rank."""
        ...


@runtime_checkable
class TensorParallelLayer(SplitParameters, Protocol):
    def checkpoint_layouts(self) -> dict[str, TPLayout | None]:
        """{own parameter name (not recursive): how it is split over the tensor-parallel group, or None when
        every tp rank holds it whole}."""
        ...


def has_tensor_parallel_layers(module: torch.nn.Module) -> bool:
    """Some module of `module` says how its parameters are split over the tensor-parallel group."""
    return any(isinstance(m, TensorParallelLayer) for m in module.modules())


def model_layouts(module: torch.nn.Module) -> Layouts:
    """{parameter name (first names, as `named_parameters()`): layout} of the tensor-parallel layers' split
    parameters; replicated and identity layouts are left out."""
    owners: dict[int, TPLayout | None] = {}
    for m in module.modules():
        if isinstance(m, TensorParallelLayer):
            for local, layout in m.checkpoint_layouts().items():
                owners[id(getattr(m, local))] = layout
    layouts = {name: owners.get(id(p)) for name, p in module.named_parameters()}
    return {name: layout for name, layout in layouts.items() if layout is not None and not is_identity(layout)}


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (over every group a `SplitParameters` module splits over): `module.state_dict()` with every
    parameter at full size in the layout of the model before it was split, each a fresh tensor; tied names
    share one tensor. The caller gathers what ZeRO-3 partitions first (`zero.GatheredParameters`)."""
    full: dict[int, torch.Tensor | None] = {}
    for m in module.modules():  # every rank visits the same modules in the same order: the gathers match
        if isinstance(m, SplitParameters):
            for local, p in m.named_parameters(recurse=False):
                if id(p) not in full:  # a tied weight is gathered once
                    full[id(p)] = m.full_parameter(local)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):  # a module's `_extra_state`
            out[name] = value
            continue
        if id(value) not in done:
            gathered = full.get(id(value))
            done[id(value)] = gathered if gathered is not None else value.detach().clone()
        out[name] = done[id(value)]
    return out
