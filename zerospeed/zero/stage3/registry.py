"""Which FlatParam owns a (stage-3 sharded) parameter — looked up by identity, never stored on it."""
from __future__ import annotations

import weakref

import torch

_OWNERS: dict[int, tuple[weakref.ref, object]] = {}


def register(param: torch.nn.Parameter, owner, *, held_elsewhere: bool = False) -> None:
    """Record `owner` as `param`'s. An owner that something else keeps alive (an engine's flat
    parameters: its strategy holds them) is recorded weakly: a strong entry would keep the owner, and
    through it every parameter and shard, alive for the life of the process after the engine and the
    model are dropped (the owner holds its parameters; the entry dies with the parameter). zero.Init's
    owners have no other holder until an engine re-registers their parameters: those stay strong."""
    key = id(param)
    _OWNERS[key] = (weakref.ref(param, lambda _r, k=key, d=_OWNERS: d.pop(k, None)),
                    weakref.ref(owner) if held_elsewhere else owner)


def unregister(param: torch.nn.Parameter) -> None:
    """`param` is an ordinary parameter again (its value was made whole)."""
    _OWNERS.pop(id(param), None)


def owner_of(param: torch.Tensor):
    """The FlatParam that shards `param`, or None for an ordinary parameter."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]() if isinstance(entry[1], weakref.ref) else entry[1]


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's full shape, also while sharded (DeepSpeed's `param.ds_shape`)."""
    owner = owner_of(param)
    if owner is None:
        return param.shape
    return owner.shapes[next(i for i, p in enumerate(owner.params) if p is param)]


def full_numel(param: torch.Tensor) -> int:
    """The parameter's full element count, also while sharded (DeepSpeed's `param.ds_numel`)."""
    n = 1
    for d in full_shape(param):
        n *= d
    return n


_EXTERNAL: dict[int, tuple[weakref.ref, list]] = {}


def register_external(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    key = id(module)
    if key not in _EXTERNAL or _EXTERNAL[key][0]() is not module:
        _EXTERNAL[key] = (weakref.ref(module, lambda _r, k=key, d=_EXTERNAL: d.pop(k, None)), [])
    _EXTERNAL[key][1].append(param)


def externals(module: torch.nn.Module) -> list:
    """Parameters declared (register_external_parameter) as used by `module` but owned elsewhere."""
    entry = _EXTERNAL.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else []
