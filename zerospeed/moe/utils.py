"""DeepSpeed's `deepspeed.moe.utils`: telling expert parameters from dense ones, and the optimizer param
groups that keep them apart (`"moe": True, "name": "ep_size_N"`: each expert group reduces, and its
ZeRO state shards, over its expert-data-parallel ranks; Note [reduction groups] in zero/strategy.py).

Every name imports whether or not a model uses MoE. Which parameters are experts' comes from their
tags (Note [expert parameter tags], moe/experts.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.moe.experts import expert_group_name
from zerospeed.moe.layer import MoE
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger
from zerospeed.zero import tags

logger = get_logger(__name__)

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: elements per expert param group


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` holds an MoE layer, the number of experts of the first one; 0 without)."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of an MoE layer's experts."""
    return expert_group_name(param) is not None


def is_autoep_expert_param(param: torch.Tensor) -> bool:
    """DeepSpeed's AutoEP tag: whether `param` is an expert weight AutoEP made (zerospeed.moe.autoep)."""
    return tags.is_autoep(param)


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """(dense parameters, expert parameters), each in the order given."""
    shared, experts = [], []
    for p in params:
        (experts if is_moe_param(p) else shared).append(p)
    return shared, experts


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """(gradients of dense parameters, gradients of expert parameters), cast to each parameter's dtype;
    parameters without a gradient are skipped."""
    shared, experts = [], []
    for p in group:
        if p.grad is not None:
            (experts if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, experts


def _chunks(params: list, max_group_size) -> list[list]:
    """Consecutive runs of `params` of at most `max_group_size` elements (a larger parameter alone)."""
    if max_group_size is None:
        return [params]
    runs, run, size = [], [], 0
    for p in params:
        if run and size + p.numel() > max_group_size:
            runs.append(run)
            run, size = [], 0
        run.append(p)
        size += p.numel()
    return runs + [run] if run else runs


def split_params_into_different_moe_groups_for_optimizer(
    param_groups, max_group_size=DEFAULT_MAX_GROUP_SIZE
) -> list[dict[str, Any]]:
    """Move the expert parameters of each group into groups of their own, one per (source group, expert
    group name), marked `"moe": True` and named after the expert group; the other keys (lr, weight
    decay, ...) are the source group's. Expert groups larger than `max_group_size` elements are split.
    The dense groups come first, in order, keeping their remaining parameters (as DeepSpeed's helper,
    which edits the given dicts in place)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(
            f"split_params_into_different_moe_groups_for_optimizer: expected a param group dict or "  # noqa: TRY004 (DeepSpeed's type)
            f"a list/tuple of them, got {type(param_groups).__name__}"
        )
    expert_groups = []
    for group in param_groups:
        by_name: dict[str, list] = {}
        dense = []
        for p in group["params"]:
            name = expert_group_name(p)
            (dense if name is None else by_name.setdefault(name, [])).append(p)
        group["params"] = dense
        for name, params in sorted(by_name.items()):
            for run in _chunks(params, max_group_size):
                expert_groups.append({**group, "name": name, "moe": True, "params": run})
    return param_groups + expert_groups


def configure_moe_param_groups(model_parameters: list):
    """Param groups with the experts apart: a list of parameters becomes one dense group named
    'dense-params' plus expert groups; a list of groups is split unless it already has moe groups."""
    if not isinstance(model_parameters, list):
        raise TypeError("configure_moe_param_groups: model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                f"configure_moe_param_groups: expected tensors or param group dicts, got {type(p).__name__}"
            )
    if not model_parameters:
        return model_parameters
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def moe_param_groups(param_groups: list[dict], *, client_optimizer: bool) -> list[dict]:
    """The engine's check: expert parameters must sit in expert groups, or their gradients would be
    averaged with other ranks' different experts. Unsplit groups are split (DeepSpeed does the same
    when it builds the optimizer); a client optimizer's groups cannot be, so that is an error."""
    misplaced = [p for g in param_groups if not is_moe_param_group(g) for p in g["params"] if is_moe_param(p)]
    if not misplaced:
        return param_groups
    if client_optimizer:
        raise ConfigError(
            f"initialize: the optimizer's param groups hold {len(misplaced)} expert parameters in "
            "groups without 'moe': True; build the optimizer from "
            "zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups)"
        )
    logger.info("initialize: moving %d expert parameters into expert param groups ('moe': True)", len(misplaced))
    split = split_params_into_different_moe_groups_for_optimizer([dict(g) for g in param_groups])
    return [g for g in split if g["params"]]
