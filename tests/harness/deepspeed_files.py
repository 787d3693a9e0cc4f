"""Comparing checkpoint files DeepSpeed wrote with files written for DeepSpeed (tests only)."""

from __future__ import annotations

import torch

from zerospeed.checkpoint.deepspeed_import import _Record


def assert_same_contents(mine, theirs, where: str) -> None:
    """`mine` equals `theirs` (as read by `deepspeed_import._load`): the same keys in the same order, tensors
    of the same dtype and shape and equal values, DeepSpeed's pickled objects of the same class arguments
    and state."""
    if isinstance(theirs, _Record):
        assert isinstance(mine, _Record), where
        assert mine.args == theirs.args, where
        skip = ("args", "kwargs")
        assert {k: v for k, v in vars(mine).items() if k not in skip} == {
            k: v for k, v in vars(theirs).items() if k not in skip
        }, where
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype, where
        assert mine.shape == theirs.shape, f"{where}: {tuple(mine.shape)} != {tuple(theirs.shape)}"
        assert torch.equal(mine, theirs), f"{where}: values differ by {(mine - theirs).abs().max()}"
    elif isinstance(theirs, dict):
        assert isinstance(mine, dict), where
        assert list(mine) == list(theirs), f"{where}: keys {list(mine)} != {list(theirs)}"
        for k in theirs:
            assert_same_contents(mine[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert_same_contents(a, b, f"{where}[{i}]")
    else:
        assert mine == theirs, f"{where}: {mine!r} != {theirs!r}"
