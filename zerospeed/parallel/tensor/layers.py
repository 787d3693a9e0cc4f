"""Megatron-style tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

A column-parallel linear holds a slice of the output features (weight rows); a row-parallel linear a
slice of the input features (weight columns). Chained column -> row (an MLP, or attention whose heads
are split), the only communication is one all-reduce forward (after the row layer) and one backward
(before the column layer); see mappings.py.

Every layer records how each tp rank's parameters map onto the full ones (`shard_specs`, pure
`ShardSpec`s): the full weights can be rebuilt from the shards (`state.full_state_dict`), a norm can
count replicated parameters once, and a checkpoint can be resharded. A layer can be built from a
full weight (`from_full`, `from_linear`), so that tensor-parallel runs start from the same weights as
a one-process reference; built from sizes, it initialises the *full* weight on every rank with the
same generator state and keeps its slice, so the model does not depend on the tp size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.checkpoint.tensor_parallel import TPLayout
from zerospeed.comm import backend
from zerospeed.parallel.tensor import mappings
from zerospeed.parallel.tensor.partition import ShardSpec, Specs, assemble, column_spec, row_spec, take, vocab_spec


def _linear_init(weight: torch.Tensor) -> None:
    """nn.Linear's default initialisation (kaiming-uniform, a = sqrt(5))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _full_linear(in_features: int, out_features: int, bias: bool, init_method, dtype, device):
    """The full (unsharded) weight and bias a parallel linear layer slices, initialised like nn.Linear's
    (or by `init_method`): every rank builds the same values from the same seed."""
    full_w = torch.empty(out_features, in_features, dtype=dtype, device=device)
    (init_method or _linear_init)(full_w)
    full_b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        full_b = torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound)
    return full_w, full_b


class TensorParallelModule(nn.Module):
    """Base of the layers here: the tp group, this rank's index and every rank's parameter layouts.

    `shard_specs[name]` is a tuple of per-rank ShardSpecs for a sharded parameter, or None for one
    replicated on every tp rank (a row-parallel bias). `source_transposed` says the full weight came
    from a transformers Conv1D ([in, out]) and goes back transposed.
    """

    def _init_tp(self, group) -> None:
        self.group = group
        self.tp_size = backend.get_world_size(group)
        self.tp_rank = backend.get_rank(group)
        self.shard_specs: dict[str, Specs | None] = {}
        self.source_transposed = False

    def spec(self, name: str) -> ShardSpec | None:
        specs = self.shard_specs.get(name)
        return None if specs is None else specs[self.tp_rank]

    # -- checkpoints (the checkpoint's `TensorParallelLayer` protocol) --------------------------------------
    def _transposed(self, name: str) -> bool:
        """The full tensor is the transpose of the layer's [out, in] layout (a transformers Conv1D weight)."""
        return self.source_transposed and name == "weight"

    def checkpoint_layouts(self) -> dict[str, TPLayout | None]:
        """How each own parameter is split over the tp group (Note [canonical tensors] in
        checkpoint/tensor_parallel.py); None for one every rank holds whole."""
        return {
            name: None if specs is None else TPLayout(tuple(specs), self._transposed(name))
            for name, specs in self.shard_specs.items()
            if getattr(self, name) is not None
        }

    def full_parameter(self, name: str) -> torch.Tensor:
        """Collective over the tp group: own parameter `name` whole, in the layout of the model before it was
        split (Conv1D weights transposed back to [in, out])."""
        full = gather_full(self._parameters[name], self.shard_specs.get(name), self.group)
        return full.t().contiguous() if self._transposed(name) else full


def gather_full(local: torch.Tensor, specs: Specs | None, group) -> torch.Tensor:
    """The full tensor from every rank's `local` piece (collective over the tp group)."""
    if specs is None:
        return local.detach().clone()
    tp = backend.get_world_size(group)
    width = max(s.local_size for s in specs)
    dim = specs[0].dim
    piece = local.detach().movedim(dim, 0)
    padded = piece.new_zeros((width, *piece.shape[1:]))
    padded[: piece.shape[0]] = piece
    out = padded.new_empty((tp, *padded.shape))
    backend.all_gather_into_tensor(out, padded.contiguous().view(-1), group=group)  # flat: see mappings.py
    pieces = [out[r, : specs[r].local_size].movedim(0, dim) for r in range(tp)]
    return assemble(pieces, list(specs))


def _param(full: torch.Tensor, spec: ShardSpec | None) -> nn.Parameter:
    data = full.detach().clone() if spec is None else take(full.detach(), spec)
    return nn.Parameter(data.contiguous())


def _replica_slot(specs: Specs, rank: int) -> tuple[int, int]:
    """(this rank's replica index, number of distinct replicas) for a replicated layout."""
    distinct = sorted({s.segments for s in specs})
    return distinct.index(specs[rank].segments), len(distinct)


class ColumnParallelLinear(TensorParallelModule):
    """y = x W^T + b with W's rows (outputs) split over the tp group.

    `gather_output=True` all-gathers the local outputs into the full y; False leaves this rank's slice
    (to feed a RowParallelLinear with input_is_parallel=True). With `sequence_parallel`, the input is
    this rank's slice of the sequence (dim `sequence_dim`) and is all-gathered first (backward
    reduce-scatters) instead of the copy-to-region all-reduce of the backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        *,
        group,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: Callable[[torch.Tensor], None] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        full_w, full_b = _full_linear(in_features, out_features, bias, init_method, dtype, device)
        tp = backend.get_world_size(group)
        specs = tuple(column_spec(out_features, tp, r) for r in range(tp))
        self._build(full_w, full_b, specs, group, gather_output, sequence_parallel, sequence_dim)

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group,
        specs: Specs | None = None,
        gather_output: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
    ) -> ColumnParallelLinear:
        """This rank's slice of a full [out, in] weight (and [out] bias); `specs` (one per rank) for a fused
        or head-aware layout, default an even split of the outputs."""
        layer = cls.__new__(cls)
        tp = backend.get_world_size(group)
        specs = specs or tuple(column_spec(weight.shape[0], tp, r) for r in range(tp))
        layer._build(weight, bias, specs, group, gather_output, sequence_parallel, sequence_dim)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group, **kwargs) -> ColumnParallelLinear:
        return cls.from_full(linear.weight, linear.bias, group=group, **kwargs)

    @classmethod
    def tied_to(
        cls,
        embedding: VocabParallelEmbedding,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
    ) -> ColumnParallelLinear:
        """An output head sharing `embedding`'s (vocab-sharded) weight: the tied weight is sharded once."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._init_tp(embedding.group)
        layer.in_features, layer.out_features = embedding.embedding_dim, embedding.num_embeddings
        layer.weight = embedding.weight  # the same Parameter: one shard, two uses
        layer.register_parameter("bias", None)
        layer.shard_specs = {"weight": embedding.shard_specs["weight"]}
        layer.gather_output, layer.sequence_parallel, layer.sequence_dim = (
            gather_output,
            sequence_parallel,
            sequence_dim,
        )
        layer._replica = None
        return layer

    def _build(self, weight, bias, specs: Specs, group, gather_output, sequence_parallel, sequence_dim) -> None:
        nn.Module.__init__(self)
        self._init_tp(group)
        if len(specs) != self.tp_size:
            raise ValueError(f"{len(specs)} shard layouts for a tp group of {self.tp_size} ranks")
        if gather_output and not all(s.contiguous and s.replicas == 1 for s in specs):
            raise ValueError(
                "gather_output=True needs plain contiguous column slices; a fused or replicated "
                "layout's gathered output would not be in the full weight's order"
            )
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        mine = specs[self.tp_rank]
        self.weight = _param(weight, mine)
        self.bias = None if bias is None else _param(bias, ShardSpec(0, mine.full_size, mine.segments, mine.replicas))
        self.shard_specs = {"weight": specs}
        if bias is not None:
            self.shard_specs["bias"] = specs
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self._replica = _replica_slot(specs, self.tp_rank) if mine.replicas > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence(x, self.group, self.sequence_dim)
        else:
            x = mappings.copy_to_tensor_region(x, self.group)
        weight, bias = self.weight, self.bias
        if self._replica is not None:  # Note [replica gradient sum] in mappings.py
            weight = mappings.sum_over_replicas(weight, self.group, *self._replica)
            bias = None if bias is None else mappings.sum_over_replicas(bias, self.group, *self._replica)
        y = F.linear(x, weight, bias)
        if self.gather_output:
            sizes = [s.local_size for s in self.shard_specs["weight"]]
            y = mappings.gather_from_tensor_region(y, self.group, None if len(set(sizes)) == 1 else sizes)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), tp={self.tp_size}, gather_output={self.gather_output}"
        )


class RowParallelLinear(TensorParallelModule):
    """y = x W^T + b with W's columns (inputs) split over the tp group; the partial products are summed
    by an all-reduce (or, with `sequence_parallel`, reduce-scattered along `sequence_dim`), then the
    bias — replicated on every rank — is added once.

    `input_is_parallel=True`: x is already this rank's slice of the input features (the output of a
    ColumnParallelLinear with gather_output=False); otherwise the full x is split here.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        *,
        group,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: Callable[[torch.Tensor], None] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        full_w, full_b = _full_linear(in_features, out_features, bias, init_method, dtype, device)
        self._build(full_w, full_b, None, group, input_is_parallel, sequence_parallel, sequence_dim)

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group,
        specs: Specs | None = None,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
    ) -> RowParallelLinear:
        layer = cls.__new__(cls)
        layer._build(weight, bias, specs, group, input_is_parallel, sequence_parallel, sequence_dim)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group, **kwargs) -> RowParallelLinear:
        return cls.from_full(linear.weight, linear.bias, group=group, **kwargs)

    def _build(self, weight, bias, specs, group, input_is_parallel, sequence_parallel, sequence_dim) -> None:
        nn.Module.__init__(self)
        self._init_tp(group)
        specs = specs or tuple(row_spec(weight.shape[1], self.tp_size, r) for r in range(self.tp_size))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = _param(weight, specs[self.tp_rank])
        self.bias = None if bias is None else _param(bias, None)
        self.shard_specs = {"weight": specs}
        if bias is not None:
            self.shard_specs["bias"] = None  # replicated: added after the reduction, once
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (
            input_is_parallel,
            sequence_parallel,
            sequence_dim,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            sizes = [s.local_size for s in self.shard_specs["weight"]]
            x = mappings.scatter_to_tensor_region(x, self.group, sizes)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence(y, self.group, self.sequence_dim)
        else:
            y = mappings.reduce_from_tensor_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"tp={self.tp_size}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(TensorParallelModule):
    """An embedding whose vocabulary rows are split over the tp group (uneven splits allowed: the first
    vocab % tp ranks hold one row more). Each rank looks up the ids it owns, zeros the others, and an
    all-reduce (or, with `sequence_parallel`, a reduce-scatter along `sequence_dim`) sums the rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        group,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: Callable[[torch.Tensor], None] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        (init_method or nn.init.normal_)(full)
        if padding_idx is not None:
            with torch.no_grad():
                full[padding_idx].zero_()
        self._build(full, padding_idx, group, sequence_parallel, sequence_dim)

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        padding_idx: int | None = None,
        *,
        group,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
    ) -> VocabParallelEmbedding:
        layer = cls.__new__(cls)
        layer._build(weight, padding_idx, group, sequence_parallel, sequence_dim)
        return layer

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group, **kwargs) -> VocabParallelEmbedding:
        return cls.from_full(embedding.weight, embedding.padding_idx, group=group, **kwargs)

    def _build(self, weight, padding_idx, group, sequence_parallel, sequence_dim) -> None:
        nn.Module.__init__(self)
        self._init_tp(group)
        self.num_embeddings, self.embedding_dim = weight.shape
        specs = tuple(vocab_spec(self.num_embeddings, self.tp_size, r) for r in range(self.tp_size))
        self.shard_specs = {"weight": specs}
        ((self.vocab_start, n),) = specs[self.tp_rank].segments
        self.vocab_end = self.vocab_start + n
        self.weight = _param(weight, specs[self.tp_rank])
        self.padding_idx = padding_idx
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        rows = F.embedding(local_ids, self.weight, local_pad)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(rows, self.group, self.sequence_dim)
        return mappings.reduce_from_tensor_region(rows, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
            f"tp={self.tp_size}"
        )
