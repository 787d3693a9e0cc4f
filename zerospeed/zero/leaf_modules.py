"""ZeRO-3 leaf modules (DeepSpeed's `deepspeed.utils.set_z3_leaf_modules` family): a module flagged as a
leaf is one stage-3 unit with the parameters of its whole subtree, gathered by hooks on it alone; the
modules inside it get no hooks of their own (Note [leaf modules] in zero/stage3/strategy.py).

Two reasons to flag one. A mixture-of-experts block runs only the experts its tokens were routed to,
so per-expert hooks would gather different experts on different ranks (a collective some ranks never
join) and the recorded fetch order would change every step; as one unit every rank gathers the whole
block. And a model of many small modules pays a hook and a collective per module per pass; fewer,
larger units cut that overhead at the price of a larger gathered working set.

The flag is the attribute ``_z3_leaf`` on the module, DeepSpeed's, so code that sets it directly (or
transformers' and TRL's helpers, which call these functions) behaves the same. It is read when the
stage-3 engine is built: set it before `zerospeed.initialize`. `zero_optimization.leaf_module`
(classes / names / name_suffixes) and `stage3_module_granularity_threshold` set it from the config.
"""

from __future__ import annotations

import sys

import torch

from zerospeed.utils.logging import logger
from zerospeed.zero.tags import full_numel, leaf_module_of

# Note [granularity threshold]: DeepSpeed's rule for `stage3_module_granularity_threshold`. A module's
# granularity is its parameter count (its whole subtree) divided by its "layers": 1 for itself plus
# every module below it, where only modules that hold parameters count, a childless module counts as
# one, and a container (nn.Sequential, ModuleList, ModuleDict, ParameterList, ParameterDict) passes its
# children's count through without counting itself. Childless modules, containers and subtrees over
# 1e9 parameters never qualify (granularity = maxsize). Walking down from the root, the first module
# whose granularity is at or below the threshold becomes a leaf and its subtree is not visited further.
# So a threshold picks the outermost modules that are "many small pieces": a transformer block of
# seven linear layers and two norms, not the model (whose embedding makes its average large).
MAX_LEAF_PARAMETERS = 10**9
_CONTAINERS = (
    torch.nn.Sequential,
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether `param` belongs to a leaf module's unit (tagged when the stage-3 engine is built)."""
    return leaf_module_of(param) is not None


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` flagged as leaves, in `modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: torch.nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified(type(module)) == wanted


def _set_by_class(model, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(
            f"leaf_module_classes must be module classes or their names (short or fully qualified), got {bad!r}"
        )
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(
            f"no module of class {classes} in {type(model).__name__}; check the class names "
            "(a name may be short, 'MixtralSparseMoeBlock', or fully qualified)"
        )
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of `model` that is an instance of one of `leaf_module_classes` (classes, or class
    names short or fully qualified) as a ZeRO-3 leaf; returns them. Raises ValueError when none matches
    (unless `raise_if_not_found` is False)."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Clear the leaf flag of the modules `set_z3_leaf_modules` would flag; returns them."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf flag of the modules named (as `named_modules()` names them); returns (modules, missing names)."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        if name in by_name:
            by_name[name]._z3_leaf = flag
            found.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(
            f"no module named {missing} in {type(model).__name__} (names as named_modules() gives them, "
            f"e.g. {next(iter(n for n in by_name if n), '')!r})"
        )
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf flag of every module whose `named_modules()` name ends with one of the suffixes; returns
    (modules, suffixes that matched nothing)."""
    named = list(model.named_modules())
    found, seen, missing = [], set(), []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            m._z3_leaf = flag
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name of {type(model).__name__} ends with {missing}")
    return found, missing


def module_granularity(model: torch.nn.Module) -> dict[int, int]:
    """id(module) -> its granularity by Note [granularity threshold] (sys.maxsize where it never qualifies)."""
    out: dict[int, int] = {}

    def walk(m: torch.nn.Module) -> tuple[int, int]:  # (layers, parameters) of the subtree
        own = sum(full_numel(p) for p in m.parameters(recurse=False))  # (zero.Init's: their full size)
        children = list(m.children())
        if not children:
            out[id(m)] = sys.maxsize
            return (1 if own else 0), own
        layers, params = 0, own
        for c in children:
            cl, cp = walk(c)
            layers, params = layers + cl, params + cp
        if params == 0 or isinstance(m, _CONTAINERS):
            out[id(m)] = sys.maxsize
            return layers, params
        layers += 1
        out[id(m)] = params // layers if params <= MAX_LEAF_PARAMETERS else sys.maxsize
        return layers, params

    walk(model)
    return out


def set_z3_leaf_modules_by_threshold(model: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """Flag the outermost modules whose granularity is at most `threshold` (Note [granularity threshold]);
    returns them. A threshold below every module's granularity flags nothing and says so."""
    if threshold <= 0:
        return []
    granularity = module_granularity(model)
    leaves: list[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        if granularity[id(m)] <= threshold:
            m._z3_leaf = True
            leaves.append(m)
            return
        for c in m.children():
            visit(c)

    visit(model)
    if not leaves:
        smallest = min(granularity.values(), default=sys.maxsize)
        logger.warning(
            f"stage3_module_granularity_threshold={threshold} flags no module: the smallest granularity "
            f"in this model is {smallest}; set the threshold at or above it to fetch modules whole"
        )
    return leaves


def apply_leaf_module_config(model: torch.nn.Module, leaf_cfg) -> list[torch.nn.Module]:
    """`zero_optimization.leaf_module` (classes / names / name_suffixes) applied to `model`: the flagged
    modules. Names or suffixes that match nothing are warned about (the default class list, transformers'
    MoE blocks, matches nothing in most models and is silent)."""
    if leaf_cfg is None:
        return []
    found: dict[int, torch.nn.Module] = {}
    for m in set_z3_leaf_modules(model, leaf_cfg.classes, raise_if_not_found=False) if leaf_cfg.classes else []:
        found[id(m)] = m
    for setter, values, what in (
        (set_z3_leaf_modules_by_name, leaf_cfg.names, "names"),
        (set_z3_leaf_modules_by_suffix, leaf_cfg.name_suffixes, "name_suffixes"),
    ):
        if values:
            hits, missing = setter(model, values, flag=True, raise_if_not_found=False)
            found.update((id(m), m) for m in hits)
            if missing:
                logger.warning(
                    f"zero_optimization.leaf_module.{what}: {missing} match no module of {type(model).__name__}"
                )
    return list(found.values())


__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "module_granularity",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "set_z3_leaf_modules_by_threshold",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


class _CallableModule(type(sys)):
    """`zerospeed.zero.leaf_modules` names both this module and its function, as `deepspeed.utils`'
    does (there the package imports the function over the submodule's name): importing the submodule
    sets the package attribute to the module, so the module itself answers a call as the function."""

    def __call__(self, model: torch.nn.Module) -> bool:
        return z3_leaf_module(model)


sys.modules[__name__].__class__ = _CallableModule
