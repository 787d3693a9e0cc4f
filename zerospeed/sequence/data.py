"""Giving each sequence-parallel rank its slice of every sequence.

`shard_sequence_batch` is pure: it shifts the labels on the full sequence (so the token after a shard
boundary is still predicted), pads the sequence to a multiple of the degree (pad tokens, -100 labels:
Note [padding is exact]) and cuts out one rank's slice of every per-token tensor, with the global
`position_ids`. `UlyssesSPDataLoaderAdapter` is DeepSpeed's adapter of that name around a DataLoader.

Note [padding is exact]: the padding goes at the end. Under causal attention a real token never attends
to a later position, so pads change no real token's output; their labels are -100, so they add nothing
to the loss or its count. The attention mask is dropped (as DeepSpeed does): right-padded batches are
causal-exact without it; left padding and packed documents need a mask this path does not rebuild.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from zerospeed import comm
from zerospeed.sequence.layout import padded_length, shard_range

IGNORE_INDEX = -100


def _pad_to(t: torch.Tensor, length: int, value) -> torch.Tensor:
    extra = length - t.shape[1]
    if extra == 0:
        return t
    pad = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def shift_labels_of(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels[:, 1:] with `ignore_index` appended: the target of every position (transformers' shift)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def shard_sequence_batch(
    batch: dict[str, Any], rank: int, world: int, *, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> dict[str, Any]:
    """Rank `rank`'s slice (of `world`) of a `[batch, seq, ...]` batch: `input_ids`, `position_ids` (made
    from 0 if absent), `labels` and `shift_labels` (made from `labels`), and every other tensor of the same
    sequence length, padded to a multiple of `world` (Note [padding is exact]). `attention_mask` is dropped."""
    if "input_ids" not in batch:
        raise KeyError("shard_sequence_batch: the batch has no 'input_ids' (a [batch, seq] tensor of token ids)")
    ids = batch["input_ids"]
    seq = ids.shape[1]
    out = {k: v for k, v in batch.items() if not torch.is_tensor(v) or v.dim() < 2 or v.shape[1] != seq}
    out.pop("attention_mask", None)
    tensors = {k: v for k, v in batch.items() if k not in out and k != "attention_mask"}
    if "position_ids" not in tensors:
        tensors["position_ids"] = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
    if "labels" in tensors and "shift_labels" not in tensors:
        tensors["shift_labels"] = shift_labels_of(tensors["labels"], ignore_index)
    length = padded_length(seq, world)
    start, stop = shard_range(seq, world, rank)
    for key, t in tensors.items():
        if key == "position_ids":  # pads continue the count; their outputs are never used
            t = torch.cat([t, torch.arange(seq, length, device=t.device).expand(t.shape[0], -1)], dim=1)
        else:
            t = _pad_to(t, length, ignore_index if "labels" in key else pad_token_id)
        out[key] = t[:, start:stop].contiguous()
    return out


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter: each of the P sequence-parallel ranks draws one batch from its own loader;
    the P batches are exchanged, and over the next P iterations every rank yields its slice of batch 0,
    then of batch 1, ... — so the P ranks work on one sequence at a time and, after P iterations, have
    consumed as many batches as P data-parallel ranks would in one. Length: len(dl) * P."""

    def __init__(
        self,
        dl,
        sp_rank: int,
        sp_group,
        sp_world_size: int,
        device,
        pad_to_sp_multiple: bool = True,
        pad_token_id: int = 0,
    ):
        if not pad_to_sp_multiple:
            raise ValueError(
                "pad_to_sp_multiple=False: zerospeed always pads sequences to a multiple of the "
                "sequence-parallel degree (the result stays exact, Note [padding is exact]); drop the "
                "argument"
            )
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device, self.pad_token_id = device, pad_token_id
        self.iter = iter(dl)
        self.micro_batches: deque = deque()
        self._started = False

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        if self._started:  # a new epoch: start the loader over
            self.iter, self.micro_batches = iter(self.dl), deque()
        self._started = True
        return self

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        mine = next(self.iter)  # StopIteration ends every rank's epoch together (same-length loaders)
        cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in mine.items()}
        for batch in comm.all_gather_object(cpu, group=self.sp_group):
            shard = shard_sequence_batch(batch, self.sp_rank, self.sp_world_size, pad_token_id=self.pad_token_id)
            self.micro_batches.append({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in shard.items()})
