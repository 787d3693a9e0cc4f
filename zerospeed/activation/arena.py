"""The contiguous buffer of ``contiguous_memory_optimization``: one allocation, reused every step.

Note [arena lifecycle]
Saved inputs take slots from one flat byte buffer with a bump cursor. A slot is released when its
checkpoint's backward has run, or when autograd frees the graph without a backward (a finalizer).
When the last live slot is released the step is over: the cursor returns to 0 and the next step
writes over the same bytes, so steady-state training allocates no saved-input storage at all.

Sizing: the buffer is allocated on the first request as ``number_checkpoints`` slots of that first
request's size. A cycle that needs more (inputs of other sizes, several tensor inputs per checkpoint,
more checkpoints than configured, or several forwards in flight before their backwards) is still
served - the excess from ordinary allocations - and at the end of that cycle the buffer is
reallocated once to the cycle's measured need. With steady shapes that happens at most once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every slot starts here-aligned, so any dtype may view it and kernels stay vectorised


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class Slot:
    """One saved input's place in the arena (or an overflow allocation); release it exactly once."""

    def __init__(self, tensor: torch.Tensor, arena: ContiguousArena, generation: int, in_buffer: bool):
        self.tensor = tensor
        self.in_buffer = in_buffer
        self._finalizer = weakref.finalize(self, arena._release, generation)

    def release(self) -> None:
        self._finalizer()  # a finalize object runs at most once, whether called here or on collection


class ContiguousArena:
    """A bump allocator over one byte buffer; ``allocate(nbytes)`` makes the uint8 storage (it decides
    the device and pinning)."""

    def __init__(self, slots: int, allocate: Callable[[int], torch.Tensor]):
        self.slots = slots
        self._allocate_bytes = allocate
        self.buffer: torch.Tensor | None = None
        self.grow_count = 0
        self.overflow_allocations = 0
        self._generation = 0
        self._cursor = 0
        self._live = 0
        self._demand = 0  # aligned bytes asked for since the cursor was last reset

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, numel: int, dtype: torch.dtype) -> Slot:
        """A 1-D ``dtype`` tensor of ``numel`` elements that stays valid until its slot is released."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = aligned(nbytes)
        if self.buffer is None:
            self._allocate(self.slots * size)
        self._live += 1
        self._demand += size
        if self._cursor + size <= self.capacity:
            view = self.buffer[self._cursor : self._cursor + nbytes].view(dtype)
            self._cursor += size
            return Slot(view, self, self._generation, in_buffer=True)
        self.overflow_allocations += 1
        return Slot(self._allocate_bytes(nbytes).view(dtype), self, self._generation, in_buffer=False)

    def reset(self) -> None:
        """Drop the buffer; slots still held keep their memory alive but no longer count."""
        self.buffer = None
        self._generation += 1
        self._cursor = self._live = self._demand = 0

    def _release(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._live -= 1
        if self._live == 0:
            self._end_cycle()

    def _end_cycle(self) -> None:
        if self._demand > self.capacity:
            logger.info(
                "activation checkpointing: contiguous buffer grown from %d to %d bytes (this step "
                "needed more than number_checkpoints=%d slots of the first input's size)",
                self.capacity,
                self._demand,
                self.slots,
            )
            self.grow_count += 1
            self._allocate(self._demand)
        self._cursor = self._demand = 0

    def _allocate(self, nbytes: int) -> None:
        self.buffer = None  # let the old buffer go before the new one is allocated
        self.buffer = self._allocate_bytes(nbytes)
