"""How one checkpointed input is kept between the forward and its recompute.

Each floating-point tensor argument ("an activation") goes through the policy's steps:
partition (keep this rank's 1/M chunk) -> place (host memory for cpu_checkpointing, a slot of the
contiguous arena, or a fresh tensor). With none of them the tensor is kept by reference, as plain
checkpointing does. Other tensors (integer ids, masks, parameters) are always kept by reference.
``SavedInput.restore`` runs the steps backwards for the recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.activation.arena import ContiguousArena, Slot
from zerospeed.activation.partition import chunk_numel, copy_partition, gather_partitions
from zerospeed.activation.policy import CheckpointingPolicy, ModelParallel

HOST = torch.device("cpu")


@dataclass
class SavedInput:
    """One tensor argument as this rank holds it until the recompute.

    ``data`` is the tensor itself (by reference), or a flat copy: this rank's chunk when
    ``partitioned``, on the host when cpu-checkpointed, possibly a view into the contiguous arena.
    """

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool = False
    by_reference: bool = False
    version: int = 0
    slot: Slot | None = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def restore(self, mp: ModelParallel, index: int) -> torch.Tensor:
        """The full input on its original device, detached, requiring grad as the original did."""
        if self.by_reference:
            self._check_unmodified(index)
            full = self.data
        else:
            local = self.data.to(self.device, non_blocking=True)
            flat = gather_partitions(local, self.numel, mp.world_size, mp.group) if self.partitioned else local
            full = flat.view(self.shape)
        return full.detach().requires_grad_(self.requires_grad)

    def release(self) -> None:
        if self.slot is not None:
            self.slot.release()
        self.slot = None
        self.data = None  # type: ignore[assignment]

    def _check_unmodified(self, index: int) -> None:
        if self.data._version != self.version:
            raise RuntimeError(
                f"checkpoint(): tensor argument {index} was modified in place after checkpoint() "
                "saved it, so the recompute would see other values; clone it before modifying it"
            )


class Stasher:
    """Applies a policy to tensor arguments; owns the contiguous arenas (one per placement device)."""

    def __init__(self, policy: CheckpointingPolicy, mp: ModelParallel):
        self.policy = policy
        self.mp = mp
        self.partition = policy.partition_activations and mp.partitions
        self.arenas: dict[torch.device, ContiguousArena] = {}

    def is_activation(self, t: torch.Tensor) -> bool:
        """Floating-point, not a parameter, and big enough to give every rank an element."""
        return t.is_floating_point() and not isinstance(t, torch.nn.Parameter) and t.numel() >= self.mp.world_size

    def save(self, t: torch.Tensor) -> SavedInput:
        if not self.is_activation(t) or not self._copies(t):
            return SavedInput(t.detach(), t.shape, t.device, t.requires_grad, by_reference=True, version=t._version)
        flat = t.detach().reshape(-1)
        numel = chunk_numel(flat.numel(), self.mp.world_size) if self.partition else flat.numel()
        dest, slot = self._destination(numel, t.dtype, HOST if self.policy.cpu_checkpointing else t.device)
        if self.partition:
            copy_partition(flat, self.mp.world_size, self.mp.rank, dest)
        else:
            dest.copy_(flat, non_blocking=True)
        return SavedInput(dest, t.shape, t.device, t.requires_grad, partitioned=self.partition, slot=slot)

    def reset(self) -> None:
        for arena in self.arenas.values():
            arena.reset()

    def _copies(self, t: torch.Tensor) -> bool:
        # cpu_checkpointing alone has nothing to move when the input already lives on the host.
        offload = self.policy.cpu_checkpointing and t.device.type != "cpu"
        return self.partition or offload or self.policy.contiguous_memory_optimization

    def _destination(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Slot | None]:
        if self.policy.contiguous_memory_optimization:
            slot = self._arena(device).take(numel, dtype)
            return slot.tensor, slot
        return _empty(numel, dtype, device), None

    def _arena(self, device: torch.device) -> ContiguousArena:
        if device not in self.arenas:
            self.arenas[device] = ContiguousArena(
                self.policy.number_checkpoints, lambda nbytes: _empty(nbytes, torch.uint8, device)
            )
        return self.arenas[device]


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised storage; host storage is pinned when an accelerator will copy it back."""
    if device.type == "cpu" and get_accelerator().name != "cpu":
        return get_accelerator().pinned_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)
