"""The partition map: which tensors a rank file holds and which parameter elements are in each.

A rank file holds a list of entries — one per tensor the optimizer steps on that rank (see
`zerospeed.zero.shards.ShardEntry`): the flat fp32 master, its elementwise optimizer state (tensors
with one value per master element, e.g. Adam's exp_avg) and its scalar state (e.g. step). The
manifest stores each entry's `EntryLayout`, so a reader knows where every parameter element is
without opening the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerospeed.zero.shards import Piece


@dataclass(frozen=True)
class EntryLayout:
    group: int  # optimizer param group index (-1 without an optimizer)
    numel: int
    pieces: tuple[Piece, ...]
    elementwise: tuple[str, ...] = ()  # optimizer state keys shaped like the master
    scalars: tuple[str, ...] = ()  # all other optimizer state keys

    def to_json(self) -> dict:
        return {
            "group": self.group,
            "numel": self.numel,
            "pieces": [[p.name, p.param_offset, p.offset, p.numel] for p in self.pieces],
            "elementwise": list(self.elementwise),
            "scalars": list(self.scalars),
        }

    @classmethod
    def from_json(cls, d: dict) -> EntryLayout:
        pieces = tuple(Piece(n, int(a), int(b), int(c)) for n, a, b, c in d["pieces"])
        return cls(
            int(d["group"]), int(d["numel"]), pieces, tuple(d.get("elementwise", ())), tuple(d.get("scalars", ()))
        )


@dataclass(frozen=True)
class RankFile:
    """One rank's shard file and the entries in it (none for ranks > 0 at stage 0, where rank 0's
    entries are everyone's). `rank` is the data-parallel rank; `tp_rank` the tensor-parallel rank, whose
    local tensors the pieces address (Note [canonical tensors] in tensor_parallel.py)."""

    rank: int
    file: str
    entries: tuple[EntryLayout, ...]
    tp_rank: int = 0

    def to_json(self) -> dict:
        d = {"rank": self.rank, "file": self.file, "entries": [e.to_json() for e in self.entries]}
        return {**d, "tp_rank": self.tp_rank} if self.tp_rank else d

    @classmethod
    def from_json(cls, d: dict) -> RankFile:
        return cls(
            int(d["rank"]), d["file"], tuple(EntryLayout.from_json(e) for e in d["entries"]), int(d.get("tp_rank", 0))
        )


def partition_from_manifest(manifest: dict) -> list[RankFile]:
    return [RankFile.from_json(d) for d in manifest["partition"]]


def split_state(state: dict, numel: int) -> tuple[list[str], list[str]]:
    """Optimizer state keys of one master: (elementwise, scalar) — elementwise means a tensor with one
    value per master element, which can be cut and re-assembled like the master itself."""
    elementwise, scalars = [], []
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel:
            elementwise.append(k)
        else:
            scalars.append(k)
    return elementwise, scalars


def entry_groups(optimizer: torch.optim.Optimizer | None, masters: list[torch.Tensor]) -> list[int]:
    """The param group index of each master (-1 where no optimizer or group holds it)."""
    if optimizer is None:
        return [-1] * len(masters)
    where = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return [where.get(id(m), -1) for m in masters]
