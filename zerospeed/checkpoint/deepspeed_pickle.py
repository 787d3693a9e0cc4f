"""Writing DeepSpeed's own objects into a checkpoint file without importing DeepSpeed.

Note [DeepSpeed's pickled classes]: DeepSpeed 0.19.8 pickles three of its classes into its checkpoint
files, and its loader uses them as objects: the loss scaler (`self.loss_scaler = state_dict['loss_scaler']`,
then `.cur_scale`, `.update_scale()`, ...), `ZeroStageEnum` and `fragment_address` (read by its
universal converter). A file DeepSpeed is to load must hold those, so `DeepSpeedObject` stands for one:
the class's import path and its pickled state. `torch.save(..., pickle_module=PICKLE_MODULE)` writes it as
the pickle opcodes DeepSpeed's own object would produce (a GLOBAL naming DeepSpeed's class, then NEWOBJ
+ BUILD, or REDUCE for an enum member); unpickling in DeepSpeed's process rebuilds the real object. The
standard pickler refuses this (it imports the class to check it), so the Python pickler's dispatch table
gets one more entry. Reading such files back without DeepSpeed is `deepspeed_import._PickleModule`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler"
ZERO_CONFIG = "deepspeed.runtime.zero.config"
TENSOR_FRAGMENT = "deepspeed.utils.tensor_fragment"


@dataclass
class DeepSpeedObject:
    """An instance of DeepSpeed's class `module.name`: built as `cls(*args)` when `args` is not None (an
    enum member), else as `cls.__new__(cls)` with `state` as its `__dict__`."""

    module: str
    name: str
    state: dict | None = None
    args: tuple | None = None


def zero_stage(stage: int) -> DeepSpeedObject:
    return DeepSpeedObject(ZERO_CONFIG, "ZeroStageEnum", args=(int(stage),))


def fragment_address(numel: int, start: int) -> DeepSpeedObject:
    return DeepSpeedObject(TENSOR_FRAGMENT, "fragment_address", {"numel": int(numel), "start": int(start)})


def loss_scaler(state: dict[str, Any]) -> DeepSpeedObject:
    """DeepSpeed's `LossScaler` (static: `{"cur_scale": s, "dynamic": False}`) or `DynamicLossScaler`."""
    return DeepSpeedObject(LOSS_SCALER, "DynamicLossScaler" if state.get("dynamic") else "LossScaler", dict(state))


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_deepspeed_object(self, obj: DeepSpeedObject) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        if obj.args is not None:
            self.save(tuple(obj.args))
            self.write(pickle.REDUCE)
        else:
            self.save(())
            self.write(pickle.NEWOBJ)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[DeepSpeedObject] = _save_deepspeed_object


class PICKLE_MODULE:  # noqa: N801 — passed as `torch.save(pickle_module=...)`, which wants a module's shape
    """`torch.save(obj, path, pickle_module=PICKLE_MODULE)`: `DeepSpeedObject`s as DeepSpeed's classes."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    __name__ = "zerospeed_deepspeed_pickle"

    @staticmethod
    def dump(obj, f, protocol=2):
        _Pickler(f, protocol=protocol).dump(obj)

    @staticmethod
    def load(f, **kwargs):
        return pickle.Unpickler(f, **kwargs).load()


class DeepSpeedStandIn:
    """One of DeepSpeed's pickled objects read back by `torch.load(weights_only=True)` inside
    `readable_deepspeed_objects()`: its constructor arguments (`args`) and attributes, nothing to run."""

    def __new__(cls, *args):
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


_READABLE = (
    f"{LOSS_SCALER}.LossScaler",
    f"{LOSS_SCALER}.DynamicLossScaler",
    f"{ZERO_CONFIG}.ZeroStageEnum",
    f"{TENSOR_FRAGMENT}.fragment_address",
)


def readable_deepspeed_objects():
    """Context for `torch.load(..., weights_only=True)` of a rank file that also holds DeepSpeed's objects (a
    tag saved with `checkpoint.deepspeed_layout`): each loads as a `DeepSpeedStandIn`, nothing else is allowed."""
    return torch.serialization.safe_globals([(DeepSpeedStandIn, name) for name in _READABLE])
