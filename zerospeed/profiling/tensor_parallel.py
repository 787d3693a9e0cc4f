"""Which counted work is this rank's own under tensor parallelism, so a model total counts it once.

Every tp rank profiles its own forward: its matmuls are the local shards (1/tp of a split layer's),
and the work around them — LayerNorms, residual adds, a row layer's bias — is repeated on every rank.
Summing the ranks' counts would count that repeated work tp times. Each tensor therefore carries a
replica count r, the number of tp ranks that compute exactly the same values:

    inputs, buffers, replicated parameters      r = tp
    a sharded parameter                         r = its ShardSpec's replicas (1; tp/kv for shared kv heads)
    an op's output                              r = min(r of its tensor inputs)
    a row-parallel layer's or the vocabulary-parallel embedding's output (after the all-reduce)
                                                r = tp (1 under sequence parallelism: a sequence slice)
    a column-parallel layer's gathered output   r = tp

and the op's work counts tp / r times in `unique` (an integer: r divides tp). The model's total is
sum over tp ranks of unique / tp — one all-reduce — or, with only a tp size, unique itself (every rank
does the same work; exact for even splits).

Note [replicated bias]: a row-parallel layer all-reduces its partial products and then adds its bias
(replicated) on every rank; the all-reduce runs inside an autograd function the counting mode cannot
see, so an op that reads a replicated parameter of the running tensor-parallel layer is credited as
replicated work (not under sequence parallelism, where the bias meets a sequence slice).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten

from zerospeed.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
)
from zerospeed.parallel.tensor.state import replica_counts


class ReplicaTracker:
    """Replica counts of the tensors of one profiled forward on one tp rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tp: int):
        self.tp = tp
        counts = replica_counts(model, tp)
        self._params = {id(p): counts[name] for name, p in model.named_parameters()}
        self._marks: dict[int, tuple[weakref.ref, int]] = {}
        self._layers: list[TensorParallelModule] = []
        self._hooks = []
        for m in model.modules():
            if isinstance(m, TensorParallelModule):
                self._hooks.append(m.register_forward_pre_hook(self._enter))
                self._hooks.append(m.register_forward_hook(self._leave))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._marks.clear()

    def replicas_of(self, t: torch.Tensor) -> int:
        if id(t) in self._params:
            return self._params[id(t)]
        entry = self._marks.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else self.tp

    def op_replicas(self, args: tuple, kwargs: dict) -> int:
        """r of an op about to run on these arguments."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self._layers and self._reads_replicated_param(self._layers[-1], tensors):
            return self.tp  # Note [replicated bias]
        return min((self.replicas_of(t) for t in tensors), default=self.tp)

    def mark(self, out, replicas: int) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self._params:
                self._marks[id(t)] = (weakref.ref(t), replicas)

    def _reads_replicated_param(self, layer: TensorParallelModule, tensors: list[torch.Tensor]) -> bool:
        if getattr(layer, "sequence_parallel", False):
            return False
        own = {id(p) for p in layer.parameters(recurse=False)}
        return any(id(t) in own and self._params.get(id(t)) == self.tp for t in tensors)

    def _enter(self, module, inputs) -> None:
        self._layers.append(module)

    def _leave(self, module, inputs, output) -> None:
        if self._layers and self._layers[-1] is module:
            self._layers.pop()
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
            self.mark(output, 1 if module.sequence_parallel else self.tp)
        elif isinstance(module, ColumnParallelLinear) and module.gather_output:
            self.mark(output, self.tp)
