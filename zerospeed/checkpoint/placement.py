"""Where this rank sits in a checkpoint, and which layouts the checkpoint format covers.

Saving, loading and importing a DeepSpeed checkpoint all start here: `check_supported` refuses what the
format cannot describe, `placement` gives this rank's data- and tensor-parallel ranks and the tensor-
parallel layouts of the model's parameters, and `checkpoint_names` how its parameters are named in
the checkpoint (global expert names, canonical full shapes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zerospeed.checkpoint.experts import CheckpointNames, expert_spans
from zerospeed.checkpoint.experts import checkpoint_names as module_names
from zerospeed.checkpoint.protocols import has_tensor_parallel_layers, model_layouts
from zerospeed.checkpoint.state import TrainingState
from zerospeed.checkpoint.tensor_parallel import Layouts, canonical_shape, writes
from zerospeed.zero.tags import owner_of


def check_supported(state: TrainingState, experts_ok: bool = False, hand_split_ok: bool = False) -> None:
    """`experts_ok`: MoE layers' expert groups are fine (save/load_checkpoint name them globally, Note
    [global expert names] in checkpoint/experts.py); other per-group reductions are not. Tensor
    parallelism is fine when the model's tensor-parallel layers (AutoTP, parallel.tensor) say how each
    parameter is split (the `TensorParallelLayer` protocol; Note [canonical tensors] in tensor_parallel.py),
    or, `hand_split_ok`, when the checkpoint says it (a DeepSpeed tag's universal_checkpoint_info: Note
    [DeepSpeed mpu tensor-parallel checkpoints] in deepspeed_mpu_tp.py)."""
    mesh = state.mesh
    tp = mesh.size("tp")
    if mesh.size("pp") > 1:
        raise NotImplementedError(
            "this engine has pipeline stages: its checkpoints are the pipeline engine's "
            "(zerospeed.parallel.pipeline.checkpoint), not these"
        )
    if mesh.world_size != zero_dp_size(state) * tp:
        raise NotImplementedError(
            f"checkpoints of this engine's layout are not supported: world size "
            f"{mesh.world_size} != sequence-data-parallel size {zero_dp_size(state)} x "
            f"tensor-parallel size {tp}"
        )
    if tp > 1:
        _check_tensor_parallel(state, tp, hand_split_ok)
        return
    # Note [MiCS]: shard-group partitions are whole dense partitions, each written by every replica alike
    mics = any(u.replicas > 1 for u in state.zero.units)
    if not state.zero.uniform_reduction and not mics and not (experts_ok and expert_spans(state.module)):
        raise NotImplementedError(
            "checkpoints of models whose param groups reduce over different groups (expert "
            "param groups, 'moe': True) are not supported yet: expert weights differ across "
            "expert-parallel ranks and would be saved under one name"
        )


def _check_tensor_parallel(state: TrainingState, tp: int, hand_split_ok: bool = False) -> None:
    if not hand_split_ok and not has_tensor_parallel_layers(state.module):
        raise NotImplementedError(
            f"checkpoints of a tensor-parallel engine (tp={tp}) whose model is split by its own "
            "code: without zerospeed's tensor-parallel layers (AutoTP's "
            '"tensor_parallel": {"autotp_size": N}, or zerospeed.parallel.tensor) the checkpoint '
            "cannot know how each parameter is split; use those layers"
        )
    groups = state.optimizer.param_groups if state.optimizer is not None else []
    if expert_spans(state.module) or any(g.get("moe") for g in groups):
        raise NotImplementedError("checkpoints of tensor-parallel models with MoE layers are not supported yet")


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in the checkpoint: its data- and tensor-parallel ranks, and the layouts of the
    model's sharded parameters ({} without tensor parallelism)."""

    dp_rank: int
    tp_rank: int
    tp: int
    layouts: Layouts

    def writes(self, name: str) -> bool:
        """Whether this tp rank saves (its piece of) parameter or buffer `name` (a first name, not an alias)."""
        return writes(self.layouts.get(name), self.tp_rank)


def zero_dp_size(state: TrainingState) -> int:
    """Note [sequence-parallel checkpoints]: the checkpoint's data-parallel size is that of the group the
    ZeRO state is partitioned over, data x sequence ranks (`dp_sp`; just `dp` without sequence
    parallelism). Ulysses shards activations, never weights: the sp ranks of a replica hold the same
    model and each holds its own slice of the dp x sp-way partitioned optimizer state, so a checkpoint
    saved at sp = P is the checkpoint of a dp x P-way data-parallel run — one rank file per dp x sp rank,
    named by its rank in that group (as DeepSpeed names them by the sequence-data-parallel rank) — and
    loads, resharded, at any other dp / sp / tp split and ZeRO stage."""
    return state.mesh.size("dp_sp")


def placement(state: TrainingState) -> Placement:
    mesh = state.mesh
    return Placement(mesh.rank_in("dp_sp"), mesh.rank_in("tp"), mesh.size("tp"), model_layouts(state.module))


def checkpoint_names(state: TrainingState, place: Placement) -> CheckpointNames:
    """experts.checkpoint_names, with each sharded parameter's canonical full shape (Note [canonical tensors])."""
    names = module_names(state.module)  # collective with MoE layers (Note [global expert names])
    if not place.layouts:
        return names
    specs = {
        n: {**s, "shape": canonical_shape(s["shape"], place.layouts.get(n), place.tp_rank)}
        for n, s in names.specs.items()
    }
    return dataclasses.replace(names, specs=specs)


def sharded_param_names(module: torch.nn.Module) -> set[str]:
    """Names (tied aliases included) of stage-3 sharded parameters: their values live in the shards."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if owner_of(p) is not None}
