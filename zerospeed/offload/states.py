"""DeepSpeed's `engine.offload_states()` / `reload_states()` and
`deepspeed.runtime.zero.offload_states.get_state_devices`.

Note [offloaded states]: to free device memory between training phases (an RLHF loop generating with
another engine on the same GPU), each selected state tensor's *storage* is copied to a host buffer
(pinned unless told otherwise) and then resized to zero bytes; `reload_states` resizes it back on its
own device and copies the bytes in. Every tensor object stays what it was: the module's parameters,
the flat buffers' views, the optimizer's state dict, the gradient slots all keep pointing at the same
storages, so no bookkeeping is rebuilt and nothing can be left pointing at a stale copy (DeepSpeed
instead swaps `.data` and rebuilds its views). Storages are handled once each: in fp32 training the
masters *are* the parameter chunks (one storage), so offloading either kind offloads both.
`contiguous_grad_buffer` is DeepSpeed's reduction staging buffer; zerospeed's staging buffers exist only
while a reduction runs, so between steps there is none to free (the kind is accepted).

Between the two calls the engine refuses forward, backward, step and checkpoints with an error naming
`reload_states()`: a zero-byte storage would otherwise fail deep inside PyTorch, or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

import torch

from zerospeed.accelerator import get_accelerator


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors go."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of engine state `engine.offload_states(include=...)` moves (DeepSpeed's names)."""

    optim_states = "optim_states"  # the optimizer's state tensors (Adam's moments)
    hp_params = "hp_params"  # fp32 master weights (this rank's partition)
    lp_params = "lp_params"  # the low-precision weights the model computes with (this rank's)
    lp_grads = "lp_grads"  # the gradient buffers (this rank's partition at stages 2-3)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # reduction staging buffers: freed, never restored


ALL_STATES = tuple(OffloadStateTypeEnum)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself, stable across Python wrappers and resizes


def _bytes_of(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffloader:
    """What `offload_states` moved: storage key -> (storage, host copy or None, its kinds)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple] = {}
        self.kinds: set[OffloadStateTypeEnum] = set()

    @property
    def active(self) -> bool:
        return bool(self.kinds)

    @torch.no_grad()
    def offload(
        self,
        tensors: dict[OffloadStateTypeEnum, list[torch.Tensor]],
        include: Iterable,
        device: str,
        pin_memory: bool,
        non_blocking: bool,
    ) -> None:
        accel = get_accelerator()
        for kind in include:
            keep_data = kind is not OffloadStateTypeEnum.contiguous_grad_buffer
            for t in tensors.get(kind, []):
                storage = t.untyped_storage()
                key = _key(t)
                if key in self.held or storage.nbytes() == 0:
                    continue
                backup = None
                if keep_data:
                    backup = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device)
                    if pin_memory:
                        backup = accel.pin_memory(backup)
                    backup.copy_(_bytes_of(storage), non_blocking=non_blocking)
                self.held[key] = (storage, backup, storage.nbytes())
                storage.resize_(0)  # queued after the copy on the same stream: safe without a sync
            self.kinds.add(kind)

    @torch.no_grad()
    def reload(self, non_blocking: bool) -> None:
        for storage, backup, nbytes in self.held.values():
            storage.resize_(nbytes)
            if backup is not None:
                _bytes_of(storage).copy_(backup, non_blocking=non_blocking)
        self.held.clear()
        self.kinds.clear()

    def device_of(self, t: torch.Tensor) -> torch.device:
        """Where `t`'s bytes are now: its host copy's device while offloaded, else its own."""
        entry = self.held.get(_key(t))
        if entry is not None and entry[1] is not None:
            return entry[1].device
        return t.device


def state_tensors(engine) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """Every tensor of each state kind on this rank: the strategy's, plus the optimizer's states."""
    out = {OffloadStateTypeEnum(k): v for k, v in engine.zero.state_tensors().items()}
    optimizer = engine.zero.optimizer_for_accessors() if engine.optimizer is not None else None
    out[OffloadStateTypeEnum.optim_states] = (
        [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)] if optimizer else []
    )
    return out


def get_state_devices(model, state: OffloadStateTypeEnum) -> set[torch.device]:
    """The devices holding `state`'s bytes on this rank (DeepSpeed's helper; `model` is the engine)."""
    offloader = model.state_offloader
    return {offloader.device_of(t) for t in state_tensors(model).get(OffloadStateTypeEnum(state), [])}
