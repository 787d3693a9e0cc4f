"""The training DataLoader built by `initialize(training_data=...)`: micro-batches, sharded by rank.

It remembers where it is inside an epoch (how many micro-batches it has handed out), so a checkpoint
can resume with exactly the next micro-batch — also at another world size, see `resume_position`.

Note [DeepSpeed's training_data order]: DeepSpeed's engine reads `training_data` through a
`DistributedSampler` with its defaults (shuffle=True, seed=0, drop_last=False: the index list is padded
with its first indices to a multiple of the world size), and `dataloader_drop_last` drops only the last
short micro-batch (runtime/dataloader.py, DeepSpeedDataLoader). Its PipelineEngine builds its own loader
with `shuffle=False` (pipe/engine.py, `_build_data_iter`): the dataset in order, rank r taking indices
r, r + world, ... `build_training_loader` makes the same choices, so the first epoch is DeepSpeed's index
for index. After it ours reshuffles per epoch (`set_epoch`); DeepSpeed never calls `set_epoch`, so it
repeats the first epoch's order (see docs/migrating_from_deepspeed.md, "Where zerospeed differs on purpose").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]


def resume_position(
    batches: int, micro_batch: int, world_size: int, new_micro_batch: int, new_world_size: int
) -> tuple[int, bool]:
    """Micro-batches per rank to skip so a resumed epoch continues where a saved one stopped.

    Every rank of a DistributedSampler takes every world_size-th index of one shuffled order, so
    after `batches` micro-batches per rank the first batches * micro_batch * world_size indices of
    that order are used, whatever the world size. Returns (position, exact): exact is False when
    the new ranks cannot start at that same index (the position is then rounded down, repeating a
    few samples rather than skipping any).
    """
    consumed = batches * micro_batch * world_size
    per_batch = new_micro_batch * new_world_size
    return consumed // per_batch, consumed % per_batch == 0


class _ResumableSampler(Sampler):
    """A DistributedSampler that can start part-way through its epoch."""

    def __init__(self, base: DistributedSampler):
        self.base = base
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.base), self.start, None)

    def __len__(self) -> int:
        return max(0, len(self.base) - self.start)


class ShardedDataLoader:
    """Yields this rank's micro-batches; each pass over it is a new epoch with a fresh shuffle.

    Every rank shuffles with the same seed and takes its own 1/world share, so the ranks' batches
    together form the global batch and never overlap within an epoch. `state_dict()` records the
    epoch in progress and how many micro-batches of it were handed out; after `load_state_dict()`
    the next pass (or a pass already in progress, e.g. inside a `RepeatingLoader` built before the
    load) continues that epoch with the next micro-batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        micro_batch: int,
        *,
        rank: int,
        world_size: int,
        collate_fn: Callable | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.micro_batch = micro_batch
        self.world_size = world_size
        self.drop_last = drop_last
        # drop_last pads the sampler, then drops the short micro-batch (Note [DeepSpeed's training_data order])
        self.sampler = _ResumableSampler(
            DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        )
        # An own generator: creating an iterator draws a worker base seed, which must not advance the
        # global torch RNG (a resumed run creates its iterator at another moment than the original).
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0  # the epoch the next pass starts
        self._pass_epoch: int | None = None  # the epoch being handed out
        self._position = 0  # micro-batches of it handed out
        self._resume: tuple[int, int] | None = None
        self._version = 0  # bumped by load_state_dict, so live passes jump to the loaded position
        self._active: _Pass | None = None  # the pass whose progress state_dict() reports

    def __len__(self) -> int:
        n = len(self.sampler.base)
        return n // self.micro_batch if self.drop_last else -(-n // self.micro_batch)

    def __iter__(self) -> Iterator:
        return _Pass(self)

    def _start_pass(self, owner_pass: _Pass) -> Iterator:
        self._active = owner_pass
        epoch, position = self._resume if self._resume is not None else (self.epoch, 0)
        self._resume = None
        self.epoch = epoch + 1
        self._pass_epoch, self._position = epoch, position
        self.sampler.set_epoch(epoch)
        self.sampler.start = position * self.micro_batch
        return iter(self.loader)

    def state_dict(self) -> dict:
        if self._resume is not None:
            epoch, position = self._resume
        elif self._pass_epoch is not None:
            epoch, position = self._pass_epoch, self._position
        else:
            epoch, position = self.epoch, 0
        return {
            "epoch": epoch,
            "position": position,
            "micro_batch": self.micro_batch,
            "world_size": self.world_size,
            "num_samples": len(self.sampler.base.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved epoch and micro-batch (converted when micro batch or world size changed)."""
        epoch, batches = int(state["epoch"]), int(state.get("position", 0))
        micro, world = int(state.get("micro_batch", self.micro_batch)), int(state.get("world_size", self.world_size))
        saved_n, n = state.get("num_samples"), len(self.sampler.base.dataset)
        if saved_n is not None and saved_n != n:
            logger.warning(
                "data sampler state is for a dataset of %d samples, this one has %d: the resumed order will differ",
                saved_n,
                n,
            )
        position, exact = resume_position(batches, micro, world, self.micro_batch, self.world_size)
        if not exact:
            logger.warning(
                "data sampler: %d samples of epoch %d were consumed at micro batch %d x %d ranks, "
                "which micro batch %d x %d ranks cannot continue exactly; resuming at micro-batch "
                "%d (a few samples repeat)",
                batches * micro * world,
                epoch,
                micro,
                world,
                self.micro_batch,
                self.world_size,
                position,
            )
        self._resume = (epoch, position)
        self.epoch = epoch
        self._version += 1


def build_training_loader(
    dataset: Dataset,
    micro_batch: int,
    *,
    rank: int,
    world_size: int,
    pipeline: bool,
    collate_fn: Callable | None = None,
    drop_last: bool = False,
) -> ShardedDataLoader:
    """The loader of `initialize(training_data=...)`, sampled as DeepSpeed samples it: shuffled (seed 0)
    for the plain engine, in order for a pipeline (Note [DeepSpeed's training_data order])."""
    return ShardedDataLoader(
        dataset,
        micro_batch,
        rank=rank,
        world_size=world_size,
        collate_fn=collate_fn,
        shuffle=not pipeline,
        seed=0,
        drop_last=drop_last,
    )


class _Pass:
    """One pass (epoch) over a ShardedDataLoader, counting what it hands out."""

    def __init__(self, owner: ShardedDataLoader):
        self.owner = owner
        self._restart()

    def _restart(self) -> None:
        self.version = self.owner._version
        self.it = self.owner._start_pass(self)
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.owner._version != self.version:
            self._restart()  # a checkpoint was loaded since this pass began
        if self.done:
            raise StopIteration
        try:
            batch = next(self.it)
        except StopIteration:
            self.done = True
            if self.owner._active is self:
                self.owner._active = None
                self.owner._pass_epoch = None  # finished: the next pass starts the next epoch
            raise
        if self.owner._active is self:
            self.owner._position += 1
        return batch


class RepeatingLoader:
    """Wraps an iterable so that it restarts (next epoch) when exhausted — an endless stream."""

    def __init__(self, loader):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def to_device(batch, device: torch.device):
    """Move a batch (tensor, or nested tuple/list/dict of tensors) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
