"""ZeRO stages 1 and 2: optimizer states (stage 1) and gradients too (stage 2) sharded across ranks.

Stage 1 accumulates full gradients locally (one flat fp32 buffer per bucket, like stage 0) and, on
the micro-step that ends the accumulation window, reduce-scatters each bucket as soon as backward
has filled it: rank r keeps the reduced chunk r in place. Stage 2 reduce-scatters on *every*
micro-step: a bucket's gradients are staged in a transient buffer, reduce-scattered, and added to
this rank's persistent fp32 gradient chunk — full gradients never outlive their bucket.

Either way the optimizer then steps only this rank's chunks (fp32 masters and optimizer states exist
for 1/N of the parameters), and each bucket's updated chunk is all-gathered back into the model's
parameter buffer. Buckets launch strictly in order (see Note [bucket launch order] in
runtime/data_parallel.py); with `overlap_comm` they run while backward continues, without it each
is waited on at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.grad_math import reduction_factors
from zerospeed.zero.flat_group import FlatParamGroup
from zerospeed.zero.partition import Bucket, group_sub_groups
from zerospeed.offload.plan import make_stepper
from zerospeed.zero.shards import Piece, ShardEntry


# Note [bounded in-flight buckets]: with overlap_comm a bucket's reduce-scatter runs while backward
# goes on; at most this many run at once — launching one more first completes the oldest. Staging
# memory (stage 2: the bucket's gradients until reduced, plus its output chunk) is then a constant
# number of reduce_bucket_size buffers, whatever the model size, instead of growing to the whole
# gradient when the network lags behind backward.
MAX_IN_FLIGHT_BUCKETS = 2


@dataclass
class _BucketState:
    group: FlatParamGroup
    bucket: Bucket
    grad_chunk: torch.Tensor  # this rank's reduced fp32 gradient (stage 1: a view of `full`)
    full: torch.Tensor | None = None  # stage 1: the full local gradient accumulation buffer
    staging: torch.Tensor | None = None  # stage 2: this micro-step's gradients, until reduced
    out: torch.Tensor | None = None
    handle: comm.Handle | None = None
    pending: int = 0
    seen: set = field(default_factory=set)


class ShardedStrategy:
    """Gradient reduction, optimizer step and parameter refresh for ZeRO stages 1 and 2."""

    def __init__(self, groups: list[dict], *, stage: int, param_dtype: torch.dtype, device: torch.device,
                 reduce_bucket_size: int, allgather_bucket_size: int, sub_group_size: int,
                 overlap_comm: bool, comm_dtype: torch.dtype | None, grad_dtype: torch.dtype = torch.float32,
                 op: str = "avg", prescale: bool = False, predivide_factor: float = 1.0,
                 ignore_unused_parameters: bool = True, dp_group=None, plan=None):
        if stage not in (1, 2):
            raise ValueError(f"ShardedStrategy handles ZeRO stages 1 and 2, not {stage}")
        self.stage = stage
        self.group = dp_group
        self.world_size = comm.get_world_size(dp_group)
        rank = comm.get_rank(dp_group)
        self.overlap_comm = overlap_comm
        self.comm_dtype = comm_dtype
        self.grad_dtype = grad_dtype
        self.allgather_bucket_size = allgather_bucket_size
        self.ignore_unused = ignore_unused_parameters
        self.pre, self.post = reduction_factors(self.world_size, op, prescale, predivide_factor)
        self.flat = [FlatParamGroup([p for p in g["params"]], {k: v for k, v in g.items() if k != "params"},
                                    bucket_size=reduce_bucket_size, world_size=self.world_size, rank=rank,
                                    param_dtype=param_dtype, device=device, plan=plan) for g in groups]
        self.plan = plan
        # fp32 gradient shards live with the masters: in host memory when the optimizer is offloaded
        grad_device = plan.master_device if plan is not None else device
        host_grads = grad_device != device
        self.states: list[_BucketState] = []
        self._slot: dict[int, tuple[_BucketState, object]] = {}
        for fg in self.flat:
            for bucket in fg.buckets:
                if stage == 1:
                    full = torch.zeros(bucket.padded, dtype=grad_dtype, device=device)
                    chunk = plan.host_zeros(bucket.chunk, grad_dtype) if host_grads else fg.chunk(bucket, full)
                    st = _BucketState(fg, bucket, chunk, full=full)
                else:
                    chunk = (plan.host_zeros(bucket.chunk, grad_dtype) if host_grads
                             else torch.zeros(bucket.chunk, dtype=grad_dtype, device=device))
                    st = _BucketState(fg, bucket, chunk)
                self.states.append(st)
                for seg in bucket.segments:
                    self._slot[id(fg.params[seg.param])] = (st, seg)
        self.sub_groups = group_sub_groups([st.bucket.chunk for st in self.states], sub_group_size)
        self._entries = [(fg, i) for fg in self.flat for i in range(len(fg.buckets))]  # one per state
        self.stepper = make_stepper(plan, [fg.masters[i] for fg, i in self._entries], self.sub_groups, rank)
        self.reducing = False
        self._next = 0
        self._in_flight: list[_BucketState] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for fg in self.flat for p in fg.params]

    # -- optimizer wiring --------------------------------------------------------------------------
    def optimizer_param_groups(self) -> list[dict]:
        return [{**fg.hparams, "params": list(fg.masters)} for fg in self.flat]

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        """Point a client optimizer's groups (built on model parameters) at this rank's masters."""
        if len(optimizer.param_groups) != len(self.flat):
            raise ValueError("client optimizer param groups do not match the groups zerospeed partitioned")
        for group, fg in zip(optimizer.param_groups, self.flat):
            group["params"] = list(fg.masters)

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        # Stage 2 reduces every micro-step: that is what keeps full gradients from persisting.
        self.reducing = sync or self.stage == 2
        self._next = 0
        for st in self.states:
            st.pending = len(st.bucket.segments)
            st.seen = set()

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        st, seg = self._slot[id(param)]
        grad = param.grad.reshape(-1)
        if self.stage == 1:
            st.full[seg.offset:seg.offset + seg.numel].add_(grad)
        else:
            if st.staging is None:
                st.staging = torch.zeros(st.bucket.padded, dtype=self.comm_dtype or self.grad_dtype,
                                         device=grad.device)
            st.staging[seg.offset:seg.offset + seg.numel].add_(grad)
        param.grad = None
        st.seen.add(seg.param)
        if self.reducing:
            st.pending -= 1
            while self._next < len(self.states) and self.states[self._next].pending <= 0:
                self._launch(self.states[self._next])
                self._next += 1

    def _launch(self, st: _BucketState) -> None:
        if st.full is not None:  # stage 1
            src = st.full if self.comm_dtype in (None, st.full.dtype) else st.full.to(self.comm_dtype)
        else:
            if st.staging is None:  # nothing used this bucket here; still take part in the collective
                st.staging = torch.zeros(st.bucket.padded, dtype=self.comm_dtype or self.grad_dtype,
                                         device=st.grad_chunk.device)
            src = st.staging
        if self.pre != 1.0:
            src.mul_(self.pre)
        # stage 1 in its own dtype reduces in place into its chunk; otherwise into a fresh chunk
        st.out = (st.group.chunk(st.bucket, st.full) if src is st.full
                  else torch.empty(st.bucket.chunk, dtype=src.dtype, device=src.device))
        st.handle = comm.reduce_scatter_tensor(st.out, src, op="sum", group=self.group, async_op=True)
        if not self.overlap_comm:
            self._complete(st)
        else:  # Note [bounded in-flight buckets]
            self._in_flight.append(st)
            while len(self._in_flight) > MAX_IN_FLIGHT_BUCKETS:
                self._complete(self._in_flight.pop(0))

    @torch.no_grad()
    def _complete(self, st: _BucketState) -> None:
        if st.handle is None:
            return
        st.handle.wait()
        st.handle = None
        if self.post != 1.0:
            st.out.mul_(self.post)
        if st.out.data_ptr() != st.grad_chunk.data_ptr():  # offloaded: this copy streams it to the host
            if st.full is not None:
                st.grad_chunk.copy_(st.out)
            else:
                st.grad_chunk.add_(st.out.to(st.grad_chunk.device))
        st.out = st.staging = None

    def start_micro_step(self) -> None:
        pass

    def end_micro_step(self) -> None:
        """Called by engine.step() after every backward: stage 2 settles this micro-step's reductions."""
        if self.stage == 2:
            self.finish_reduction()

    def finish_reduction(self) -> None:
        if not self.reducing:
            return
        self._check_unused()
        while self._next < len(self.states):
            self._launch(self.states[self._next])
            self._next += 1
        for st in self.states:
            self._complete(st)
        self._in_flight = []
        self.reducing = False

    def _check_unused(self) -> None:
        if self.ignore_unused:
            return
        names = [f"group {gi} param {i} (shape {tuple(fg.params[i].shape)})" for gi, fg in enumerate(self.flat)
                 for i in range(len(fg.params)) if not any(i in st.seen for st in self.states if st.group is fg)]
        if names:
            raise RuntimeError("parameters received no gradient this step: " + "; ".join(names[:5]) +
                               " — set zero_optimization.ignore_unused_parameters to true to allow this")

    # -- step --------------------------------------------------------------------------------------
    def global_grad_norm(self) -> float:
        """L2 norm of the full reduced gradient: local chunks' squared norms, all-reduced once."""
        return sharded_global_norm([st.grad_chunk for st in self.states], self.group)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        """Scale gradients by `coef`, step the optimizer over each sub-group, refresh parameters."""
        pairs = [(fg.masters[i], st.grad_chunk) for (fg, i), st in zip(self._entries, self.states)]
        self.stepper.step(optimizer, pairs, coef, self.sub_groups, on_stepped=self._publish)
        self._all_gather_params()

    def _publish(self, indices: list[int]) -> None:
        """Updated masters of these entries into this rank's parameter chunks, while resident."""
        for k in indices:
            fg, i = self._entries[k]
            fg.write_master_to_param(i)

    def resident(self, optimizer):
        """Context in which every master and optimizer state is in memory (checkpoint save/load)."""
        return self.stepper.resident(optimizer)

    def placement(self) -> dict[str, str]:
        """Where each kind of model state lives, read off the tensors (and the swap files)."""
        return state_placement(self.plan, params=[b for fg in self.flat for b in fg.param_buffers],
                               grads=[st.grad_chunk for st in self.states], stepper=self.stepper)

    def _all_gather_params(self) -> None:
        in_flight: list[tuple[comm.Handle, int]] = []
        flying = 0
        for fg in self.flat:
            for bucket, buffer in zip(fg.buckets, fg.param_buffers):
                while in_flight and flying + bucket.padded > self.allgather_bucket_size:
                    handle, n = in_flight.pop(0)
                    handle.wait()
                    flying -= n
                in_flight.append((comm.all_gather_into_tensor(buffer, fg.chunk(bucket, buffer),
                                                              group=self.group, async_op=True), bucket.padded))
                flying += bucket.padded
        for handle, _ in in_flight:
            handle.wait()

    def zero_grads(self) -> None:
        for st in self.states:
            (st.full if st.full is not None else st.grad_chunk).zero_()

    # -- checkpoint support ------------------------------------------------------------------------
    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        """This rank's masters (one per bucket chunk) and the parameter pieces each holds."""
        out = []
        for fg in self.flat:
            for bucket, master in zip(fg.buckets, fg.masters):
                pieces = [Piece(names[id(fg.params[s.param])], s.param_offset, s.offset, s.numel)
                          for s in bucket.rank_segments(fg.rank)]
                out.append(ShardEntry(master, pieces))
        return out

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        """After masters were overwritten (a checkpoint load): refresh every rank's full parameters."""
        for fg in self.flat:
            fg.write_masters_to_params()
        self._all_gather_params()

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        """Masters from the model's (possibly 16-bit) parameters — a module-only load."""
        for fg in self.flat:
            for bucket, buffer, master in zip(fg.buckets, fg.param_buffers, fg.masters):
                chunk = fg.chunk(bucket, buffer)
                if chunk.data_ptr() != master.data_ptr():
                    master.copy_(chunk)

    # -- introspection -----------------------------------------------------------------------------
    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        params = sum(b.nbytes for fg in self.flat for b in fg.param_buffers)
        grads = sum((st.full if st.full is not None else st.grad_chunk).nbytes for st in self.states)
        buffer_ptrs = {b.data_ptr() for fg in self.flat for b in fg.param_buffers}
        masters = sum(m.nbytes for fg in self.flat for m in fg.masters
                      if m.untyped_storage().data_ptr() not in buffer_ptrs)
        return {"parameters": params, "gradients": grads, "master_weights": masters,
                "optimizer_states": optimizer_state_bytes(optimizer)}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def swap_files(self) -> list:
        """(kind, path, bytes) of every NVMe swap file this rank owns."""
        return self.stepper.files()

    def close(self) -> None:
        """Remove the swap files (also done at exit)."""
        self.stepper.close()


def state_placement(plan, *, params: list[torch.Tensor], grads: list[torch.Tensor], stepper) -> dict[str, str]:
    """Devices of the parameter and gradient tensors; masters and optimizer states by the stepper."""
    def where(ts):
        return ",".join(sorted({str(t.device) for t in ts})) or "none"
    opt = (f"nvme:{plan.optimizer_nvme}" if stepper.kind == "nvme"
           else str(plan.master_device) if plan is not None else where(params))
    return {"parameters": where(params), "gradients": where(grads), "master_weights": opt,
            "optimizer_states": opt}


def sharded_global_norm(chunks: list[torch.Tensor], group) -> float:
    """sqrt of the sum over ranks of each rank's squared chunk norms (one all-reduce, fp64)."""
    device = chunks[0].device if chunks else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for c in chunks:
        local += torch.linalg.vector_norm(c, dtype=torch.float64) ** 2
    # offloaded gradient chunks live on the host; the collective runs on the communication device
    local = local.to(get_accelerator().device(comm.get_local_rank()))
    comm.all_reduce(local, op="sum", group=group)
    return math.sqrt(float(local))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
