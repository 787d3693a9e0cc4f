"""Tensor-parallel checkpoints: how a parameter's tp pieces become one full tensor, and back.

Note [canonical tensors]: inside a checkpoint every parameter has one *canonical* full form — the
tensor of the model before sharding, in the layout `parallel.tensor.full_state_dict` returns (a
transformers Conv1D weight as [in, out], although AutoTP's Linear replacement holds its slice of the
transpose, [out, in]). The manifest's `parameters` record canonical shapes, so a checkpoint describes
the same model at every tp degree and the model check compares like with like; a sharded parameter's
`TPLayout` (its per-rank ShardSpecs, in the layer's own [out, in] layout, and whether the canonical
form is that layout's transpose) says how each rank's local tensor sits in it. The layers give their
layouts through the `TensorParallelLayer` protocol (protocols.py).

    canonical C  --(transpose when `transposed`)-->  layer layout M  --take(M, spec_r)-->  rank r's local

Saving writes each distinct piece once (`writer_ranks`): replicated parameters (LayerNorm, a row
bias) from tp rank 0 only, GQA kv heads shared by several ranks from the first of them. Loading
assembles C from the writers' pieces (`assemble_full`) and cuts the loading rank's piece out of it
with the loading engine's layout (`reslice`) — any tp degree, without an offline conversion.

Everything here is a function of layouts, shapes and tensors in hand (no process group).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from zerospeed.checkpoint.slices import ShardSpec, assemble, take
from zerospeed.zero.shards import Piece


@dataclass(frozen=True)
class TPLayout:
    """How a sharded parameter is split over the tp ranks (Note [canonical tensors])."""

    specs: tuple[ShardSpec, ...]  # one per tp rank, in the layer's [out, in] layout
    transposed: bool = False  # the canonical tensor is the transpose of the layer layout (Conv1D)

    @property
    def tp(self) -> int:
        return len(self.specs)

    def to_json(self) -> dict:
        return {
            "transposed": self.transposed,
            "specs": [
                {
                    "dim": s.dim,
                    "full_size": s.full_size,
                    "segments": [list(g) for g in s.segments],
                    "replicas": s.replicas,
                }
                for s in self.specs
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> TPLayout:
        specs = tuple(
            ShardSpec(
                int(s["dim"]),
                int(s["full_size"]),
                tuple((int(a), int(n)) for a, n in s["segments"]),
                int(s.get("replicas", 1)),
            )
            for s in d["specs"]
        )
        return cls(specs, bool(d.get("transposed", False)))


Layouts = dict[str, TPLayout]
"""{parameter name: layout} for the sharded parameters; a name absent is replicated (or tp is 1)."""


def is_identity(layout: TPLayout) -> bool:
    """One rank holding the whole tensor in its canonical layout: nothing to record."""
    return layout.tp == 1 and not layout.transposed and layout.specs[0].segments == ((0, layout.specs[0].full_size),)


def layouts_to_json(layouts: Layouts) -> dict:
    return {name: layout.to_json() for name, layout in layouts.items()}


def layouts_from_json(d: dict | None) -> Layouts:
    return {name: TPLayout.from_json(v) for name, v in (d or {}).items()}


def writer_ranks(layout: TPLayout | None) -> list[int]:
    """The tp ranks that save a parameter: one per distinct piece (the first rank holding it)."""
    if layout is None:
        return [0]
    seen, ranks = set(), []
    for r, spec in enumerate(layout.specs):
        if spec.segments not in seen:
            seen.add(spec.segments)
            ranks.append(r)
    return ranks


def writes(layout: TPLayout | None, rank: int) -> bool:
    return rank in writer_ranks(layout)


def _layer_shape(canonical: list[int], layout: TPLayout) -> list[int]:
    if not layout.transposed:
        return list(canonical)
    if len(canonical) != 2:
        raise ValueError(f"a transposed (Conv1D) layout needs a 2-d tensor, got shape {list(canonical)}")
    return [canonical[1], canonical[0]]


def local_shape(canonical: list[int], layout: TPLayout | None, rank: int) -> list[int]:
    """Shape of rank's local tensor of a parameter whose canonical full shape is `canonical`."""
    if layout is None:
        return list(canonical)
    shape = _layer_shape(canonical, layout)
    spec = layout.specs[rank]
    if spec.dim >= len(shape) or shape[spec.dim] != spec.full_size:
        raise ValueError(
            f"full shape {list(canonical)} (layer layout {shape}) does not have {spec.full_size} "
            f"entries along dim {spec.dim}, as its shard layout says"
        )
    shape[spec.dim] = spec.local_size
    return shape


def canonical_shape(local: list[int], layout: TPLayout | None, rank: int) -> list[int]:
    """The canonical full shape of a parameter from rank's local shape (inverse of `local_shape`)."""
    if layout is None:
        return list(local)
    shape = list(local)
    spec = layout.specs[rank]
    shape[spec.dim] = spec.full_size
    return [shape[1], shape[0]] if layout.transposed else shape


def assemble_full(pieces: dict[int, torch.Tensor], layout: TPLayout | None) -> torch.Tensor:
    """The canonical full tensor from the writer ranks' local pieces ({tp rank: tensor in local shape})."""
    if layout is None:
        return pieces[0]
    ranks = writer_ranks(layout)
    missing = [r for r in ranks if r not in pieces]
    if missing:
        raise ValueError(f"the pieces of tp ranks {missing} are missing")
    full = assemble([pieces[r] for r in ranks], [layout.specs[r] for r in ranks])
    return full.t().contiguous() if layout.transposed else full


def reslice(full: torch.Tensor, layout: TPLayout | None, rank: int) -> torch.Tensor:
    """Rank's local tensor (layer layout) of the canonical full tensor `full`."""
    if layout is None:
        return full
    return take(full.t() if layout.transposed else full, layout.specs[rank])


def pack_pieces(flat: torch.Tensor, pieces: list[Piece], keep: set[str]) -> tuple[torch.Tensor, list[Piece]]:
    """(the elements of the pieces named in `keep`, concatenated; those pieces re-addressed into it).

    A rank saves only what no other tp rank saves (`writer_ranks`): its flat ZeRO entries also hold
    replicated parameters, which tp rank 0 alone writes. When every piece is kept `flat` itself comes
    back, unchanged (a same-layout load then copies the file as it is)."""
    kept = [p for p in pieces if p.name in keep]
    if len(kept) == len(pieces):
        return flat, list(pieces)
    parts, out, offset = [], [], 0
    for p in kept:
        parts.append(flat[p.offset : p.offset + p.numel])
        out.append(Piece(p.name, p.param_offset, offset, p.numel))
        offset += p.numel
    packed = torch.cat(parts) if parts else flat.new_empty(0)
    return packed, out


def local_numel(canonical: list[int], layout: TPLayout | None, rank: int) -> int:
    return prod(local_shape(canonical, layout, rank))


def layout_problem(name: str, canonical: list[int], layout: TPLayout | None, tp: int) -> str | None:
    """Why `layout` (this engine's, for `tp` ranks) cannot cut the checkpoint's canonical tensor, or None."""
    if layout is None:
        return None
    if layout.tp != tp:
        return f"parameter {name!r} has {layout.tp} shard layouts for a tensor-parallel group of {tp} ranks"
    try:
        for r in range(layout.tp):
            local_shape(canonical, layout, r)
    except ValueError as exc:
        return f"parameter {name!r}: {exc}"
    return None
