"""Checkpoints of models with MoE layers: global expert names and DeepSpeed's per-expert files.

Note [global expert names]: a rank holds `E / ep` experts of each MoE layer under local names
(`...deepspeed_experts.{j}...`), and which global expert `j` is depends on the rank and the ep size
(Note [expert parallel layout] in moe/sharded_moe.py: global `e = ep_rank * E / ep + j`). Inside a
checkpoint every expert tensor is named by its *global* index instead — in the rank files' pieces,
the manifest's parameter specs and module keys, and the expert files. The checkpoint then describes
one model with all E experts, whatever ep it was saved at; loading maps the global names back onto
the loading rank's own experts, so a checkpoint loads at any ep and data-parallel size, and
consolidates to the state dict of the same model at ep = 1. A layer says which experts it holds
through the `HoldsExperts` protocol (protocols.py; DeepSpeed's `MoE` and AutoEP's containers implement it).

Expert files: `layer_{i}_expert_{e}_mp_rank_00_model_states.pt` (DeepSpeed's name; i counts MoE
layers in module order) holds expert e's state dict in the training dtype under global keys,
written by rank 0 of the expert's expert-data-parallel group. The main model-states file leaves the
experts out, as DeepSpeed's does.

Note [stacked expert checkpoints]: AutoEP keeps a block's experts stacked in one tensor per weight
(`experts.gate_up_proj [E/ep, 2I, H]`: rows first .. first + E/ep - 1 of the model's `[E, 2I, H]`),
under the model's own name on every rank. Inside a checkpoint such a parameter is the whole `[E, ...]`
tensor: its spec records the full shape, and each piece of it a rank's shard holds is addressed by its
element offset in that whole tensor (the local offset + first x the elements of one expert), so the
shards of all ep ranks together describe every expert once, consolidate to transformers' own tensor,
and a loading rank cuts its own rows out at any ep size. The expert files hold one row (expert e's
matrix) under the parameter's name; blocks count in module order with `MoE` layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from zerospeed import comm
from zerospeed.checkpoint.atomic import atomic_torch_save
from zerospeed.checkpoint.manifest import file_record, param_specs
from zerospeed.checkpoint.protocols import HoldsExperts
from zerospeed.zero import GatheredParameters
from zerospeed.zero.shards import ShardEntry


@dataclass(frozen=True)
class ExpertSpan:
    """This rank's experts of one MoE layer."""

    layer: int  # index among the model's MoE layers, in module order
    prefix: str  # qualified name of the layer's expert ModuleList, e.g. "blocks.0.moe.deepspeed_moe.experts..."
    first: int  # global index of local expert 0
    local: int  # experts on this rank
    writer: bool  # rank 0 of the experts' expert-data-parallel group: writes their files
    stacked: tuple[str, ...] = ()  # AutoEP: the [E/ep, ...] parameters (Note [stacked expert checkpoints])
    total: int = 0  # the layer's experts (AutoEP)

    def globalize(self, key: str) -> str | None:
        """The global name of a local key under this layer's experts; None for any other key."""
        if self.stacked:
            return key if key in self.stacked else None
        if not key.startswith(self.prefix + "."):
            return None
        j, _, rest = key[len(self.prefix) + 1 :].partition(".")
        return f"{self.prefix}.{self.first + int(j)}.{rest}"

    def localize(self, key: str) -> str | None:
        """The local name of a global key of one of this rank's experts; None otherwise."""
        if self.stacked:
            return key if key in self.stacked else None
        if not key.startswith(self.prefix + "."):
            return None
        e, _, rest = key[len(self.prefix) + 1 :].partition(".")
        j = int(e) - self.first
        return f"{self.prefix}.{j}.{rest}" if 0 <= j < self.local else None

    def expert_of(self, global_key: str) -> int:
        return int(global_key[len(self.prefix) + 1 :].partition(".")[0])


def expert_file_name(layer: int, expert: int) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def _qualified(module_name: str, name: str) -> str:
    return ".".join(part for part in (module_name, name) if part)


def expert_spans(module: torch.nn.Module) -> list[ExpertSpan]:
    """This rank's experts of every layer holding experts (the `HoldsExperts` protocol), in module order."""
    spans = []
    for name, m in module.named_modules():
        if isinstance(m, HoldsExperts):
            share = m.checkpoint_experts()
            spans.append(
                ExpertSpan(
                    len(spans),
                    _qualified(name, share.experts),
                    share.first,
                    share.local,
                    share.writer,
                    tuple(_qualified(name, p) for p in share.stacked),
                    share.total,
                )
            )
    return spans


def globalize(key: str, spans: list[ExpertSpan]) -> str:
    for span in spans:
        if (g := span.globalize(key)) is not None:
            return g
    return key


def is_expert_key(key: str, spans: list[ExpertSpan]) -> bool:
    return any(span.globalize(key) is not None for span in spans)


@dataclass(frozen=True)
class CheckpointNames:
    """How one rank's model appears in a checkpoint (Note [global expert names])."""

    spans: list[ExpertSpan]
    params: dict[int, str]  # id(parameter) -> checkpoint name
    specs: dict[str, dict]  # checkpoint name -> {shape, dtype, trainable}, every rank's experts included
    module_keys: list[str]  # the full model's state-dict keys, every rank's experts included
    offsets: dict[str, int] = field(default_factory=dict)  # stacked experts: local element 0's in the whole

    @property
    def has_experts(self) -> bool:
        return bool(self.spans)

    def global_entries(self, entries: list[ShardEntry]) -> list[ShardEntry]:
        """`entries` with each piece of a stacked expert parameter addressed in the whole tensor (Note
        [stacked expert checkpoints]); the others as they are."""
        if not self.offsets:
            return entries
        return [
            ShardEntry(
                e.master,
                [
                    dataclasses.replace(p, param_offset=p.param_offset + self.offsets[p.name])
                    if p.name in self.offsets
                    else p
                    for p in e.pieces
                ],
            )
            for e in entries
        ]


def checkpoint_names(module: torch.nn.Module) -> CheckpointNames:
    """Collective when the model has MoE layers (one all-gather of names and specs)."""
    spans = expert_spans(module)
    params = {id(p): globalize(n, spans) for n, p in module.named_parameters()}
    specs = {globalize(n, spans): s for n, s in param_specs(module).items()}
    offsets = {}
    for span in spans:  # Note [stacked expert checkpoints]: the whole [E, ...] tensor
        for name in span.stacked:
            shape = list(specs[name]["shape"])
            offsets[name] = span.first * prod(shape[1:])
            specs[name] = {**specs[name], "shape": [span.total, *shape[1:]]}
    keys = [globalize(k, spans) for k in module.state_dict()]
    if spans:
        specs, keys = _merge(comm.all_gather_object((specs, keys)))
    return CheckpointNames(spans, params, specs, keys, offsets)


def _merge(per_rank: list[tuple[dict, list]]) -> tuple[dict, list]:
    """Union of every rank's specs and keys, keys in first-seen order (rank 0's order for the dense ones)."""
    specs, keys, seen = {}, [], set()
    for rank_specs, rank_keys in per_rank:
        specs.update(rank_specs)
        for k in rank_keys:
            if k not in seen:
                seen.add(k)
                keys.append(k)
    return specs, keys


def write_expert_files(
    module: torch.nn.Module, spans: list[ExpertSpan], directory: Path
) -> tuple[dict[str, dict], str | None]:
    """Collective (stage 3 gathers each expert over its expert-dp group, so every rank goes through
    every expert even after a failed write): (the files this rank wrote, name -> record; an error)."""
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    files, error = {}, None
    for span in spans:
        if span.stacked:
            files, error = _write_stacked(span, state, directory, files, error)
            continue
        for j in range(span.local):
            local_prefix = f"{span.prefix}.{j}."
            keys = [k for k in state if k.startswith(local_prefix)]
            with GatheredParameters([state[k] for k in keys if isinstance(state[k], torch.nn.Parameter)]):
                if not span.writer or error is not None:
                    continue
                name = expert_file_name(span.layer, span.first + j)
                try:
                    atomic_torch_save(
                        {span.globalize(k): state[k].detach().cpu().clone() for k in keys}, directory / name
                    )
                    files[name] = file_record(directory / name)
                except OSError as exc:
                    error = f"rank {comm.get_rank()} could not write expert file {directory / name}: {exc}"
    return files, error


def _write_stacked(
    span: ExpertSpan, state: dict, directory: Path, files: dict, error: str | None
) -> tuple[dict, str | None]:
    """One file per expert of an AutoEP block: row j of each stacked parameter (Note [stacked expert
    checkpoints]); collective at stage 3 like `write_expert_files`."""
    with GatheredParameters([state[k] for k in span.stacked]):
        if not span.writer or error is not None:
            return files, error
        for j in range(span.local):
            name = expert_file_name(span.layer, span.first + j)
            try:
                atomic_torch_save({k: state[k][j].detach().cpu().clone() for k in span.stacked}, directory / name)
                files[name] = file_record(directory / name)
            except OSError as exc:
                return files, f"rank {comm.get_rank()} could not write expert file {directory / name}: {exc}"
    return files, error


def local_expert_files(spans: list[ExpertSpan]) -> list[str]:
    return [expert_file_name(span.layer, span.first + j) for span in spans for j in range(span.local)]


@torch.no_grad()
def load_expert_files(module: torch.nn.Module, spans: list[ExpertSpan], tag_dir: Path, skip: set[str]) -> None:
    """Copy this rank's experts from their files into the module (names in `skip` — stage-3 sharded
    parameters, whose values come from the shards — are left alone)."""
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    for span in spans:
        for j in range(span.local):
            saved = torch.load(
                Path(tag_dir) / expert_file_name(span.layer, span.first + j),
                map_location="cpu",
                mmap=True,
                weights_only=True,
            )
            for key, value in saved.items():
                local = span.localize(key)
                if local is None or local not in state or local in skip:
                    continue
                (state[local][j] if span.stacked else state[local]).copy_(value)
