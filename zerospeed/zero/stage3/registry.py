"""Which FlatParam owns a (stage-3 sharded) parameter — looked up by identity, never stored on it."""
from __future__ import annotations

import weakref

import torch

_OWNERS: dict[int, tuple[weakref.ref, object]] = {}


def register(param: torch.nn.Parameter, owner) -> None:
    key = id(param)
    _OWNERS[key] = (weakref.ref(param, lambda _r, k=key: _OWNERS.pop(k, None)), owner)


def owner_of(param: torch.Tensor):
    """The FlatParam that shards `param`, or None for an ordinary parameter."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]


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
