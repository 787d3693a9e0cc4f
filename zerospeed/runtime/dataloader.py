"""The training DataLoader built by `initialize(training_data=...)`: micro-batches, sharded by rank."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ShardedDataLoader:
    """Yields this rank's micro-batches; each pass over it is a new epoch with a fresh shuffle.

    Every rank shuffles with the same seed and takes its own 1/world share, so the ranks' batches
    together form the global batch and never overlap within an epoch.
    """

    def __init__(self, dataset: Dataset, micro_batch: int, *, rank: int, world_size: int,
                 collate_fn: Callable | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False):
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=micro_batch, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


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
