"""What ZeRO needs to know about a parameter that other code decides: one typed tag on the parameter,
and the parameters a module declares it uses (`register_external_parameter`) on the module.

Note [parameter tags]: DESIGN.md says not to bolt attributes onto nn.Parameter, and the lifecycle of a
sharded parameter belongs to its owner object (FlatParam), not to the parameter. A few facts still
have to travel *with* a parameter, because the code that knows them is not the code that reads them:

- which expert group it reduces over ("ep_size_N"): the MoE package (moe/experts.py, moe/autoep.py)
  writes it, ZeRO, checkpoints, the estimator and the integrations read it. ZeRO must not import the
  MoE package (core never imports features, docs/architecture.md), so the fact cannot be an
  `isinstance` or a lookup in moe/;
- whether AutoEP made it (DeepSpeed's `is_autoep_expert_param`);
- its stage-3 owner (the FlatParam that shards it: `owner_of`, `full_shape`), the strategy whose fp32
  state trains it (Note [parameter fragments], zero/fragment.py), and the ZeRO-3 leaf module whose
  unit gathers it (DeepSpeed's `ds_z3_leaf_module`, Note [leaf modules] in zero/stage3/strategy.py).

These used to live in process-wide registries keyed by `id(param)` (three of them, each with weak
references and callbacks to forget dead entries). They are one `ParamTag` in one attribute now: a
small dataclass, typed, without closures, the only thing zerospeed attaches to a parameter. The tag
lives and dies with its parameter, so nothing is left behind when a model is dropped, and no id can
be reused by a later parameter. Lifetimes are as before (Note [owners held weakly]).

Note [owners held weakly]: an owner that something else keeps alive (an engine's FlatParams: the
strategy holds them) is held through a weak reference, so a kept model does not keep a dropped
engine's shards, masters and gradients alive (tests/dist/test_engine_lifetime.py). zero.Init's owners
have no other holder until an engine re-partitions their parameters: the tag holds those strongly,
a cycle (owner -> its parameters -> their tags -> owner) that dies with the model. The strategy that
trains a parameter and the leaf module are held weakly too: the tag never extends a lifetime.

A tag survives pickling with its durable facts (expert group, AutoEP) and without the runtime ones
(owners, strategy, leaf); `torch.load(weights_only=True)` accepts it. `copy.deepcopy` of a parameter
does not copy attributes: the MoE containers tag their copies again (their `__setstate__`).
DeepSpeed's own expert attributes (`param.allreduce = False`, `param.group_name`) and leaf attribute
(`param.ds_z3_leaf_module`), set by someone else's code, are honoured by the readers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

_TAG = "_zerospeed_tag"  # Note [parameter tags]: the one attribute zerospeed sets on a parameter
_EXTERNALS = "_zerospeed_external_params"  # on a module: parameters its forward uses, owned elsewhere


@dataclass(eq=False)
class ParamTag:
    """Note [parameter tags]. Read it through the functions of this module, not directly."""

    expert_group: str | None = None  # "ep_size_N": an expert parameter; None: a dense one
    autoep: bool = False  # made by AutoEP (zerospeed.moe.autoep)
    owner: object = None  # the stage-3 FlatParam sharding it, or a weakref.ref to one (Note [owners held weakly])
    index: int = -1  # the parameter's position in `owner.params`
    trainer: weakref.ref | None = None  # the strategy training it (Note [parameter fragments])
    leaf_module: weakref.ref | None = None  # the ZeRO-3 leaf module whose unit gathers it

    def __reduce__(self):  # the durable facts only: no owners, strategies or modules in a pickle
        return ParamTag, (self.expert_group, self.autoep)


torch.serialization.add_safe_globals([ParamTag])  # a pickled tagged parameter loads with weights_only=True


def tag_of(param: torch.Tensor) -> ParamTag | None:
    """`param`'s tag, or None if nothing tagged it."""
    return param.__dict__.get(_TAG)


def tag(param: torch.Tensor) -> ParamTag:
    """`param`'s tag, created empty on first use (for writers)."""
    t = param.__dict__.get(_TAG)
    if t is None:
        t = ParamTag()
        setattr(param, _TAG, t)
    return t


# -- experts (written by zerospeed.moe) ----------------------------------------------------------------


def mark_expert(param: torch.Tensor, group_name: str, *, autoep: bool = False) -> None:
    """Tag `param` as an expert parameter of expert group `group_name` ("ep_size_N")."""
    t = tag(param)
    t.expert_group = group_name
    t.autoep = autoep


def expert_group(param: torch.Tensor) -> str | None:
    """The expert group ("ep_size_N") `param` belongs to, or None for a dense parameter."""
    t = tag_of(param)
    if t is not None and t.expert_group is not None:
        return t.expert_group
    if getattr(param, "allreduce", True) is False:  # tagged the DeepSpeed way
        return getattr(param, "group_name", None) or "ep_size_1"
    return None


def is_autoep(param: torch.Tensor) -> bool:
    """Whether AutoEP made `param` (one of its expert-parallel expert weights)."""
    t = tag_of(param)
    return t is not None and t.autoep


# -- the stage-3 owner ---------------------------------------------------------------------------------


def set_owner(owner, *, held_elsewhere: bool = False) -> None:
    """Record `owner` (a FlatParam) as the owner of each of `owner.params`; weakly when
    `held_elsewhere` (Note [owners held weakly])."""
    ref = weakref.ref(owner) if held_elsewhere else owner
    for i, p in enumerate(owner.params):
        t = tag(p)
        t.owner, t.index = ref, i


def clear_owner(param: torch.Tensor) -> None:
    """`param` is an ordinary parameter again (its value was made whole, or it was dropped)."""
    t = tag_of(param)
    if t is not None:
        t.owner, t.index = None, -1


def owner_of(param: torch.Tensor):
    """The FlatParam that shards `param`, or None for an ordinary parameter."""
    t = tag_of(param)
    owner = None if t is None else t.owner
    return owner() if isinstance(owner, weakref.ref) else owner


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's full shape, also while sharded (DeepSpeed's `param.ds_shape`)."""
    owner = owner_of(param)
    return param.shape if owner is None else owner.shapes[tag_of(param).index]


def full_numel(param: torch.Tensor) -> int:
    """The parameter's full element count, also while sharded (DeepSpeed's `param.ds_numel`)."""
    n = 1
    for d in full_shape(param):
        n *= d
    return n


# -- the strategy that trains it, the leaf that gathers it -------------------------------------------


def set_trainer(params, strategy) -> None:
    """Record `strategy` as the one training `params` (the newest claim wins; held weakly)."""
    ref = weakref.ref(strategy)
    for p in params:
        tag(p).trainer = ref


def trainer_of(param: torch.Tensor):
    """The live strategy that trains `param`, or None (frozen, or not under an engine)."""
    t = tag_of(param)
    return None if t is None or t.trainer is None else t.trainer()


def set_leaf_module(param: torch.Tensor, leaf: torch.nn.Module) -> None:
    """`param` is gathered by the unit of the ZeRO-3 leaf module `leaf` (held weakly)."""
    tag(param).leaf_module = weakref.ref(leaf)


def leaf_module_of(param: torch.Tensor) -> torch.nn.Module | None:
    """The ZeRO-3 leaf module whose unit gathers `param` (DeepSpeed's `ds_z3_leaf_module`), or None."""
    t = tag_of(param)
    if t is not None and t.leaf_module is not None:
        return t.leaf_module()
    return getattr(param, "ds_z3_leaf_module", None)  # set by DeepSpeed's code


# -- external parameters (state on the module that uses them) ----------------------------------------


def add_external(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param`, owned by another module. Kept on `module` (so a
    deep copy of the model keeps the declaration, pointing at the copied parameter)."""
    declared = module.__dict__.setdefault(_EXTERNALS, [])
    if not any(q is param for q in declared):
        declared.append(param)


def externals(module: torch.nn.Module) -> list:
    """Parameters declared (`register_external_parameter`) as used by `module` but owned elsewhere."""
    return module.__dict__.get(_EXTERNALS, [])


__all__ = [
    "ParamTag",
    "add_external",
    "clear_owner",
    "expert_group",
    "externals",
    "full_numel",
    "full_shape",
    "is_autoep",
    "leaf_module_of",
    "mark_expert",
    "owner_of",
    "set_leaf_module",
    "set_owner",
    "set_trainer",
    "tag",
    "tag_of",
    "trainer_of",
]
