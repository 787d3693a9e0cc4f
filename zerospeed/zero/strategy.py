"""The contract between the engine and a ZeRO strategy, and what every strategy shares.

The engine, the pipeline engine and `zerospeed.checkpoint` talk to a strategy only through
`ZeroStrategy`: they ask its capabilities (`supports_no_sync`, `weights_in_shards`,
`replicated_state`), never its stage number. The stage is resolved once, in
`zerospeed.zero.build_strategy`; `stage` is kept for reports and the checkpoint manifest only.

Note [reduction groups]: every parameter group reduces its gradients over its own process group
(`ReductionGroup`): dense weights over the data-parallel (x sequence-parallel) ranks, expert
weights (a param group with DeepSpeed's `"moe": True, "name": "ep_size_N"`) over the
expert-data-parallel ranks of the mesh. Sharded stages shard the group's optimizer state over the
same ranks. The global gradient norm stays exact: each rank's squared norm of a gradient is
weighted by 1 / (ranks of the norm group holding that same value) — 1 for a shard, 1/world for an
all-reduced (replicated) gradient — and the weighted sums are all-reduced once over the norm group.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.utils.errors import ConfigError


@runtime_checkable
class ZeroStrategy(Protocol):
    stage: int  # for reports and manifests only: callers ask the capabilities below
    supports_no_sync: bool  # gradients can accumulate unreduced across micro-steps
    weights_in_shards: bool  # trainable weights exist only as shards (the module holds placeholders)
    replicated_state: bool  # every rank holds the same masters and optimizer states
    uniform_reduction: bool  # every param group reduces over the norm group (no expert groups)

    def optimizer_param_groups(self) -> list[dict]: ...
    def retarget(self, optimizer: torch.optim.Optimizer) -> None: ...
    def start_micro_step(self) -> None: ...
    def release_gathered(self) -> None: ...
    def begin_backward(self, sync: bool) -> None: ...
    def end_micro_step(self) -> None: ...
    def finish_reduction(self) -> None: ...
    def global_grad_norm(self) -> float: ...
    def transform_gradients(self, optimizer: torch.optim.Optimizer, scale: float) -> bool: ...
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None: ...
    def zero_grads(self) -> None: ...
    def shard_entries(self, names: dict[int, str]) -> list: ...
    def sync_params_from_masters(self) -> None: ...
    def load_masters_from_params(self) -> None: ...
    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]: ...
    def resident(self, optimizer) -> contextlib.AbstractContextManager: ...
    def placement(self) -> dict[str, str]: ...
    def swap_files(self) -> list: ...
    def state_tensors(self) -> dict[str, list[torch.Tensor]]: ...  # Note [offloaded states]
    def memory_breakdown(self, optimizer) -> dict[str, int]: ...
    def remove_hooks(self) -> None: ...
    def close(self) -> None: ...
    # Note [parameter fragments] (zero/fragment.py): DeepSpeed's safe_get_* / safe_set_* accessors
    def bind_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None: ...
    def optimizer_for_accessors(self) -> torch.optim.Optimizer | None: ...
    def param_fragment(self, param: torch.Tensor): ...  # -> zero.fragment.ParamFragment | None
    def refresh_weights(self, param: torch.Tensor, value: torch.Tensor) -> None: ...
    def frozen_values(self, keep: bool) -> dict[int, torch.Tensor]: ...
    def load_frozen(self, values: dict[int, torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class ReductionGroup:
    """The ranks one parameter group's gradients reduce over (and its optimizer state shards over)."""

    group: object  # process group handle; None = the world
    world_size: int
    rank: int
    replica_group: object = None
    """Note [MiCS]: the ranks holding the same partition in the other shard groups (None: there are none)."""
    replicas: int = 1

    @classmethod
    def of(cls, group) -> ReductionGroup:
        return cls(group, comm.get_world_size(group), comm.get_rank(group))


_EP_NAME = re.compile(r"ep_size_(\d+)")


def reduction_groups(param_groups: list[dict], mesh, mics_shard_size: int = 0) -> list[ReductionGroup]:
    """Note [reduction groups]: the group of each param group, in order (dense ones over MiCS shard groups
    when `mics_shard_size` > 0: Note [MiCS])."""
    dense = ReductionGroup.of(mesh.group("dp_sp"))
    if mics_shard_size > 0:
        shard, replica = mesh.mics_axes(mics_shard_size)
        dense = ReductionGroup(
            shard.handle, shard.size, shard.rank, replica.handle if replica.size > 1 else None, replica.size
        )
    if dense.replicas > 1 and any(g.get("moe") for g in param_groups):
        raise ConfigError(
            f"zero_optimization.mics_shard_size={mics_shard_size} with MoE expert param groups: MiCS "
            "shard groups are not built for expert parallelism; remove one"
        )
    return [_expert_group(g, i, mesh) if g.get("moe") else dense for i, g in enumerate(param_groups)]


def resolve_mics_shard_size(
    size: int, *, stage: int, mesh, hpz_size: int = 1, quantized_gradients: bool = False
) -> int:
    """`zero_optimization.mics_shard_size` (`size`) when MiCS is on (else 0), refusing what it is not built
    with: the ZeRO `stage`, the `mesh`'s other axes, and ZeRO++'s hpZ / qgZ.

    Note [MiCS]: MiCS (DeepSpeed's `MiCS_Init` / `MiCS_Optimizer`) is ZeRO-3 whose partitions span a
    shard group of `mics_shard_size` consecutive data-parallel ranks (a node, typically) instead of all
    of them: parameters, gradients and optimizer states are split S ways, parameter all-gathers stay
    inside the shard group, and the model is replicated across the R = dp / S shard groups. A gradient is
    reduce-scattered inside the shard group, then each chunk is all-reduced over its replica group (the
    ranks holding the same chunk) and averaged over all S x R ranks; the norm counts each chunk once
    (1/R on every replica). Memory per rank is 1/S of the model states instead of 1/dp, traded for
    gathers that never cross a shard group."""
    size = int(size)
    if size <= 0:
        return 0
    refused = [
        (stage != 3, f"zero_optimization.stage={stage} (MiCS partitions at stage 3 only; set stage 3)"),
        (
            mesh.size("tp") > 1 or mesh.size("sp") > 1 or mesh.size("pp") > 1,
            "tensor, sequence or pipeline parallelism (MiCS is built over plain data parallelism)",
        ),
        (
            int(hpz_size) > 1,
            (
                "zero_hpz_partition_size > 1 (hpZ's secondary partition "
                "is another way to keep gathers inside a node; use one)"
            ),
        ),
        (bool(quantized_gradients), ("zero_quantized_gradients (qgZ's all-to-all is not built over shard groups)")),
    ]
    problems = [why for bad, why in refused if bad]
    if problems:
        raise ConfigError(f"zero_optimization.mics_shard_size={size} cannot be combined with " + "; ".join(problems))
    return size


def _expert_group(g: dict, index: int, mesh) -> ReductionGroup:
    match = _EP_NAME.fullmatch(str(g.get("name", "")))
    if match is None:
        raise ConfigError(
            f"param group {index} has 'moe': True but name={g.get('name')!r}; expert param groups are "
            "named 'ep_size_<N>' (zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer "
            "and DeepSpeed's helper of that name make them)"
        )
    return ReductionGroup.of(mesh.expert_data_parallel_group(int(match.group(1))))


def weighted_global_norm(parts: list[tuple[torch.Tensor, float]], group) -> float:
    """sqrt of the all-reduced sum of weight * |tensor|^2 (fp64, one collective; Note [reduction groups]).

    Partial sums are taken on each tensor's own device, then moved once to the communication device:
    offloaded gradients live on the host, the collective runs where the backend needs it."""
    comm_device = get_accelerator().torch_device(comm.get_local_rank())
    by_device: dict[torch.device, torch.Tensor] = {}
    for t, weight in parts:
        sq = torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 * weight
        by_device[t.device] = by_device[t.device] + sq if t.device in by_device else sq
    total = torch.zeros((), dtype=torch.float64, device=comm_device)
    for partial in by_device.values():
        total += partial.to(comm_device)
    comm.all_reduce(total, op="sum", group=group)
    value = float(total)
    return math.sqrt(value) if value >= 0 else value


_UNBOUND = object()


class ReducingStrategy:
    """What every strategy does the same way with its `self.reducer` (a zero.reducer.GradientReducer):
    start a backward, settle the reduction that backward started, zero, unhook; and the optimizer
    the parameter accessors read states from (Note [parameter fragments] in zero/fragment.py)."""

    bound_optimizer = _UNBOUND
    norm_weights: dict[int, float] | None = None
    """Note [norm weights]: id(parameter) -> the weight its squared gradient norm counts with (None: all
    1). Under tensor parallelism a parameter held identically by r tensor-parallel ranks counts 1/r on
    each, and the norm group spans the tensor-parallel ranks too, so every parameter of the full model
    is counted once (`zerospeed.parallel.tensor.replica_counts`)."""

    def set_norm_weights(self, weights: dict[int, float] | None, group) -> None:
        """Count parameters with `weights` in the global gradient norm, all-reduced over `group`."""
        self.norm_weights, self.norm_group = weights, group
        self.uniform_reduction = False

    def _weighted_parts(self, full: bool) -> list[tuple[torch.Tensor, float]]:
        """Per parameter piece of this rank's gradients: (piece, weight) by `norm_weights`. `full`: each
        unit holds its whole (replicated) buffer (stage 0), counted 1/world on every rank of its group;
        otherwise this rank's chunk of it."""
        parts = []
        for u in self.units:
            buf = u.accum if full else u.result
            pieces = u.layout.segments if full else u.layout.rank_segments(u.rank)
            scale = 1.0 / u.world_size if full else 1.0 / u.replicas  # Note [MiCS]: each chunk once
            for s in pieces:
                weight = self.norm_weights.get(id(u.params[s.param]), 1.0)
                parts.append((buf[s.offset : s.offset + s.numel], scale * weight))
        return parts

    def begin_backward(self, sync: bool) -> None:
        self.reducer.begin(sync)

    def start_micro_step(self) -> None:
        pass

    def release_gathered(self) -> None:
        """Weights gathered beyond this rank's share back to it (stage 3; nothing below it)."""

    def end_micro_step(self) -> None:
        """After every backward: settle the reduction it started (every micro-step at stages 2-3, the
        boundary one at stages 0-1), so that gradients are final when backward returns, as DeepSpeed's
        are (its stage 0-1 all-reduce runs inside engine.backward too)."""
        self.reducer.finish()

    def bind_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimizer the engine steps with: where the accessors find optimizer states."""
        self.bound_optimizer = optimizer

    def optimizer_for_accessors(self) -> torch.optim.Optimizer | None:
        if self.bound_optimizer is _UNBOUND:
            raise RuntimeError(
                "optimizer states are not reachable: the engine has not bound its optimizer "
                "to the ZeRO strategy (engine.zero.bind_optimizer(engine.optimizer))"
            )
        return self.bound_optimizer

    def has_grads(self) -> bool:
        """Gradients arrived since the last zeroing (the accessors answer None otherwise)."""
        return self.reducer.holds_grads

    def finish_reduction(self) -> None:
        self.reducer.finish()

    def transform_gradients(self, optimizer: torch.optim.Optimizer, scale: float) -> bool:
        """Replace the reduced gradients by the optimizer's update before the norm; True if done. Only
        sharded strategies do (Note [Muon on ZeRO shards], optim/muon.py): whole tensors step as they are."""
        return False

    def zero_grads(self) -> None:
        self.reducer.zero()

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()

    def frozen_values(self, keep: bool) -> dict[int, torch.Tensor]:
        """Full values of frozen parameters the module does not hold whole (stage 3): none here."""
        return {}

    def load_frozen(self, values: dict[int, torch.Tensor]) -> None:
        """Frozen parameters the module holds whole load through its state dict: nothing to do."""


def full_module_state(module: torch.nn.Module | None, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The module's own state dict (cast to `dtype`): what a strategy that keeps whole weights on every
    rank returns as its full state dict."""
    if module is None:
        return {}
    return {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in module.state_dict().items()
    }


def state_placement(plan, *, params: list[torch.Tensor], grads: list[torch.Tensor], stepper) -> dict[str, str]:
    """Devices of the parameter and gradient tensors; masters and optimizer states by the stepper."""

    def where(ts):
        return ",".join(sorted({str(t.device) for t in ts})) or "none"

    opt = (
        f"nvme:{plan.optimizer_nvme}"
        if stepper.kind == "nvme"
        else str(plan.master_device)
        if plan is not None
        else where(params)
    )
    return {"parameters": where(params), "gradients": where(grads), "master_weights": opt, "optimizer_states": opt}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's tensors: its states, plus any it keeps outside them (a 1-bit optimizer's
    compression errors and, under ZeRO, its whole momentum: `unsaved_state_bytes`)."""
    if optimizer is None:
        return 0
    extra = getattr(optimizer, "unsaved_state_bytes", None)
    return sum(
        v.nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ) + (extra() if extra is not None else 0)
