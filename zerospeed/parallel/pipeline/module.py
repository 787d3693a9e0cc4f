"""`PipelineModule`: a model written as a list of layers, of which each rank builds only its own.

Layers are `LayerSpec`s (built only by the stage that owns them), `TiedLayerSpec`s (one module per key
and rank, shared by every layer with that key — e.g. the token embedding and the output head — whose
gradient is summed across the stages that hold it), plain modules, or plain callables.

The list is split into `num_stages * chunks` parts (partition.py); part `vs` (a virtual stage) lives
on pipeline stage `vs % num_stages` as its chunk `vs // num_stages`. The pipeline x data x tensor rank
grid comes from `zerospeed.comm.RankGrid` and its process groups from `comm.ParallelGroups`.

Note [tensor parallelism inside stages]: a stage's layers may be tensor-parallel (zerospeed.parallel.
tensor layers); they need the tp group when they are built, so the layout is made first —
`mesh = ParallelMesh.build(pp=P, tp=T)` — the layers are given `mesh.group("tp")`, and the module is
given `topology=mesh` (its groups are reused, not made twice). Everything that pairs ranks across
stages (activations, tied weights, the loss broadcast) pairs ranks with the same data- and
tensor-parallel index, so each tp rank of a stage talks to the same tp rank of the next one.

Note [pipeline activation checkpointing]: with `activation_checkpoint_interval = k > 0` a stage cuts its
layers into blocks of k (counted from the stage's first layer, as DeepSpeed does) and runs each block
that holds parameters (or whose classes are all in `checkpointable_layers`) through
`activation_checkpoint_func`: it keeps the block's inputs only and recomputes the block in backward.
DeepSpeed's default is its re-entrant `checkpointing.checkpoint` (here `zerospeed.activation.checkpoint`,
which also follows the `activation_checkpointing` section: partitioned, CPU-held inputs);
`pipeline.use_reentrant=false` picks `non_reentrant_checkpoint` (torch's saved-tensor hooks). A re-entrant
block sees gradients only through inputs that require them: DeepSpeed marks the first stage's floating
inputs so, and with integer inputs (token ids into an embedding) the block's weights would get no
gradient. Here a block none of whose inputs requires a gradient runs non-re-entrant instead: the same
recomputation, and every weight gets its gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerospeed import activation, comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.parallel.pipeline.partition import partition
from zerospeed.parallel.pipeline.topology import ProcessTopology
from zerospeed.utils.errors import ConfigError

logger = logging.getLogger(__name__)


class LayerSpec:
    """A layer to build later: `typename(*module_args, **module_kwargs)`, only on its owning stage."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module (and so its `tied_weight_attr`) is shared by every spec with the same key.

    `forward_fn(module, x)` replaces `module(x)` where given (e.g. the output head reusing the
    embedding's weight). `tied_weight_attr` may be a dotted path or a list of them.
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


@dataclass(frozen=True)
class TieInfo:
    """Where a tied key lives: the pipeline stages holding it (the lowest one owns it)."""

    key: str
    stages: tuple[int, ...]
    attrs: tuple[str, ...]


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", type(layer).__name__)


def _param_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):  # counting must not allocate the whole model on every rank
                module = layer.build()
        except Exception:  # a layer that cannot be built on meta: build it for real, once
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def non_reentrant_checkpoint(function: Callable, *args: Any) -> Any:
    """`function(*args)` recomputed in backward through torch's saved-tensor hooks (DeepSpeed's
    `checkpointing.non_reentrant_checkpoint`, chosen by `pipeline.use_reentrant=false`)."""
    return checkpoint(function, *args, use_reentrant=False)


def get_attr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class PipelineModule(nn.Module):
    """The part of a layered model that this rank runs; see the module docstring."""

    def __init__(
        self,
        layers: list,
        num_stages: int | None = None,
        topology: comm.RankGrid | ProcessTopology | ParallelMesh | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        chunks: int = 1,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
    ):
        super().__init__()
        if not layers:
            raise ConfigError("PipelineModule: `layers` is empty")
        if activation_checkpoint_interval < 0:
            raise ConfigError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        comm.init_distributed()
        mesh = topology if isinstance(topology, ParallelMesh) else None
        if mesh is not None and mesh.grid is None:
            raise ConfigError(
                "PipelineModule: the mesh given as topology wraps an mpu's groups and has no rank grid; "
                "build it with ParallelMesh.build(pp=..., tp=...) instead"
            )
        self.grid = _resolve_grid(num_stages, mesh.grid if mesh is not None else topology, comm.get_world_size())
        self.num_stages, self.chunks = self.grid.pp, chunks
        if chunks < 1 or (chunks > 1 and self.num_stages < 2):
            raise ConfigError(f"PipelineModule: chunks={chunks}: interleaving needs chunks >= 1 and at least 2 stages")
        self._layer_specs = list(layers)
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or activation.checkpoint
        self.checkpointable_layers = checkpointable_layers
        self.partition_method = partition_method
        self.seed_layers = seed_layers
        self.bounds = self.partition_bounds(self.num_stages * chunks)
        self.global_rank = comm.get_rank()
        self.stage_id = self.grid.coords(self.global_rank)["pp"]
        self.ties = self._tie_infos()
        self.groups = comm.ParallelGroups(mesh) if mesh is not None else comm.ParallelGroups.build(self.grid)
        self.tie_groups = self._build_tie_groups()
        self.tied_modules = nn.ModuleDict()
        self.layer_modules = nn.ModuleDict()
        self._funcs: dict[int, Callable] = {}
        self._build(seed_layers, base_seed)
        logger.info(
            "pipeline stage %d/%d holds layers %s",
            self.stage_id,
            self.num_stages,
            [list(self.layer_range(c)) for c in range(chunks)],
        )

    # -- layout ------------------------------------------------------------------------------------
    def partition_bounds(self, num_parts: int) -> list[int]:
        """The layer bounds of this module's partition method over `num_parts` parts (its own stages x chunks,
        or another run's stage count: a DeepSpeed checkpoint's)."""
        layers, method = self._layer_specs, self.partition_method
        return partition(
            method,
            class_names=[_class_name(l) for l in layers],
            param_counts=[_param_count(l) for l in layers]
            if method.lower() in ("parameters", "best")
            else [0] * len(layers),
            num_parts=num_parts,
        )

    def tied_layers(self) -> dict[int, str]:
        """Layer index -> tie key of every TiedLayerSpec in the layer list."""
        return {i: l.key for i, l in enumerate(self._layer_specs) if isinstance(l, TiedLayerSpec)}

    def virtual_stage(self, chunk: int, stage: int | None = None) -> int:
        return chunk * self.num_stages + (self.stage_id if stage is None else stage)

    def layer_range(self, chunk: int, stage: int | None = None) -> range:
        vs = self.virtual_stage(chunk, stage)
        return range(self.bounds[vs], self.bounds[vs + 1])

    def stage_of_layer(self, idx: int) -> int:
        vs = next(k for k in range(len(self.bounds) - 1) if self.bounds[k] <= idx < self.bounds[k + 1])
        return vs % self.num_stages

    def local_layer_indices(self) -> list[int]:
        return [i for c in range(self.chunks) for i in self.layer_range(c)]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _tie_infos(self) -> dict[str, TieInfo]:
        stages: dict[str, set[int]] = {}
        attrs: dict[str, tuple[str, ...]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_of_layer(idx))
                attrs.setdefault(layer.key, tuple(layer.tied_weight_attr))
        return {k: TieInfo(k, tuple(sorted(stages[k])), attrs[k]) for k in sorted(stages)}

    def _build_tie_groups(self) -> dict[str, Any]:
        """Per tied key held by several stages: the group of those stages at this data- and tensor-parallel
        index (Note [tensor parallelism inside stages]).

        new_group is collective: every rank creates every group, in the same (sorted) order.
        """
        out = {}
        me = self.grid.coords(self.global_rank)
        for key, tie in self.ties.items():
            if len(tie.stages) < 2:
                continue
            for d in range(self.grid.dp):
                for t in range(self.grid.tp):
                    ranks = [self.grid.rank(pp=s, dp=d, tp=t) for s in tie.stages]
                    handle = None if len(ranks) == self.grid.world_size else comm.new_group(ranks)
                    if (d, t) == (me["dp"], me["tp"]) and self.stage_id in tie.stages:
                        out[key] = (handle, ranks)
        return out

    def _build(self, seed_layers: bool, base_seed: int) -> None:
        first_idx = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first_idx.setdefault(layer.key, idx)
        for idx in self.local_layer_indices():
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    if seed_layers:  # the key's first layer index: every holder builds the same weights
                        torch.manual_seed(base_seed + first_idx[layer.key])
                    self.tied_modules[layer.key] = layer.build()
            elif isinstance(layer, LayerSpec):
                if seed_layers:
                    torch.manual_seed(base_seed + idx)
                self.layer_modules[str(idx)] = layer.build()
            elif isinstance(layer, nn.Module):
                self.layer_modules[str(idx)] = layer
            elif callable(layer):
                self._funcs[idx] = layer
            else:
                raise TypeError(f"layer {idx} is {layer!r}: expected a LayerSpec, an nn.Module or a callable")

    # -- running ----------------------------------------------------------------------------------
    def _call_layer(self, idx: int, x: Any) -> Any:
        layer = self._layer_specs[idx]
        if isinstance(layer, TiedLayerSpec):
            module = self.tied_modules[layer.key]
            return layer.forward_fn(module, x) if layer.forward_fn is not None else module(x)
        if idx in self._funcs:
            return self._funcs[idx](x)
        return self.layer_modules[str(idx)](x)

    def _run(self, start: int, end: int, x: Any) -> Any:
        for idx in range(start, end):
            x = self._call_layer(idx, x)
        return x

    def forward_chunk(self, chunk: int, x: Any) -> Any:
        """Run this rank's chunk on `x` (a tensor or a tuple of tensors, passed to each layer as is)."""
        layers = self.layer_range(chunk)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(layers.start, layers.stop, x)
        for start in range(layers.start, layers.stop, interval):  # Note [pipeline activation checkpointing]
            stop = min(start + interval, layers.stop)
            checkpointed = self._is_checkpointable(start, stop)
            x = self._checkpointed(start, stop, x) if checkpointed else self._run(start, stop, x)
        return x

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every `interval` layers from the next forward on (0: off), as DeepSpeed's module."""
        if interval < 0:
            raise ConfigError(f"activation_checkpoint_interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def _is_checkpointable(self, start: int, stop: int) -> bool:
        if self.checkpointable_layers is not None:
            return all(_class_name(self._layer_specs[i]) in self.checkpointable_layers for i in range(start, stop))
        modules = [self.layer_module(i) for i in range(start, stop)]
        return any(m is not None and any(True for _ in m.parameters()) for m in modules)

    def _checkpointed(self, start: int, stop: int, x: Any) -> Any:
        packed = isinstance(x, tuple)
        args = x if packed else (x,)
        func = self.activation_checkpoint_func
        if func is not non_reentrant_checkpoint and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in args
        ):
            func = non_reentrant_checkpoint  # Note [pipeline activation checkpointing]
        return func(lambda *xs: self._run(start, stop, xs if packed else xs[0]), *args)

    def forward(self, x: Any) -> Any:
        """The whole model; only defined when one rank holds every layer (a single stage)."""
        if self.num_stages != 1:
            raise RuntimeError(
                "PipelineModule.forward runs the whole model only with one stage; with "
                f"{self.num_stages} stages use engine.train_batch() / eval_batch()"
            )
        return self.forward_chunk(0, x)

    # -- per-layer state (checkpoints) -----------------------------------------------------------
    def layer_module(self, idx: int) -> nn.Module | None:
        """The module holding layer `idx`'s state on this rank (None for a function layer)."""
        layer = self._layer_specs[idx]
        if isinstance(layer, TiedLayerSpec):
            return self.tied_modules[layer.key]
        return self.layer_modules[str(idx)] if str(idx) in self.layer_modules else None

    @property
    def num_layers(self) -> int:
        return len(self._layer_specs)


def _resolve_grid(
    num_stages: int | None, topology: comm.RankGrid | ProcessTopology | None, world: int
) -> comm.RankGrid:
    if isinstance(topology, ProcessTopology):  # DeepSpeed's PipeDataParallelTopology & co.
        try:
            topology = topology.to_grid()
        except ValueError as exc:
            raise ConfigError(f"PipelineModule: {exc}") from None
    if topology is not None:
        if topology.world_size != world:
            raise ConfigError(
                f"PipelineModule: topology {topology.shape} has {topology.world_size} ranks but the job has {world}"
            )
        if num_stages is not None and num_stages != topology.pp:
            raise ConfigError(f"PipelineModule: num_stages={num_stages} disagrees with topology pp={topology.pp}")
        if topology.sp != 1 or topology.ep != 1:
            raise ConfigError(
                f"PipelineModule: topology {topology.shape} has sequence- or expert-parallel ranks; "
                "pipelines combine with data and tensor parallelism only (sp = ep = 1)"
            )
        return topology
    if num_stages is None:
        raise ConfigError("PipelineModule: give num_stages or topology")
    try:
        return comm.RankGrid.for_world(world, pp=num_stages)
    except ValueError as exc:
        raise ConfigError(f"PipelineModule: num_stages={num_stages}: {exc}") from None
