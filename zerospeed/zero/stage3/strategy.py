"""ZeRO stage 3: parameters sharded too, gathered one unit at a time around its forward and backward.

Units: every module that directly owns trainable parameters. A parameter belongs to the first module
(in `named_modules()` order) that registers it; any other module that registers it too (a tied output
head) or was told so by `register_external_parameter` gathers the owner's unit when it runs.

Forward: a module's pre-hook gathers the units it uses (waiting on any prefetch), its post-hook
releases them unless persistent. Backward: a backward pre-hook re-gathers them; once every parameter
of a flat parameter has its gradient (post-accumulate hooks), the full tensors are released and the
gradient is reduce-scattered into this rank's fp32 gradient chunk — launches in a fixed order, as in
stage 2 (Note [bucket launch order]). The optimizer steps the fp32 master chunks, exactly as stage 2.

Note [stage-3 prefetch order]: every fetch in a micro-step is recorded. From the next micro-step on,
fetching the k-th unit of the recording (and it matching) issues async gathers for the following
units, up to `stage3_prefetch_bucket_size` elements in flight and `stage3_max_live_parameters`
resident. A fetch that does not match the recording stops prefetching for the rest of that
micro-step and a new recording replaces the old: control-flow changes cost speed, never correctness.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from zerospeed import comm
from zerospeed.runtime.grad_math import reduction_factors
from zerospeed.zero.partition import group_sub_groups
from zerospeed.offload.plan import HOST, make_param_swapper, make_stepper
from zerospeed.zero.sharded import MAX_IN_FLIGHT_BUCKETS, optimizer_state_bytes, sharded_global_norm, state_placement
from zerospeed.zero.shards import Piece, ShardEntry
from zerospeed.zero.stage3 import registry
from zerospeed.zero.stage3.flat_param import FlatParam, Residency, State, start_gathers


# A backward pre-hook on a module whose inputs need no gradient (an embedding) is exactly what stage 3
# wants; torch warns about that case on every call.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                          "respect to module outputs since no inputs require gradients")


@dataclass
class _Grad:
    staging: torch.Tensor | None = None
    pending: int = 0


class Stage3Strategy:
    stage = 3

    def __init__(self, module: torch.nn.Module, groups: list[dict], *, param_dtype: torch.dtype,
                 device: torch.device, reduce_bucket_size: int, sub_group_size: int, overlap_comm: bool,
                 prefetch_bucket_size: int, max_live_parameters: int, param_persistence_threshold: int,
                 max_reuse_distance: int = 1_000_000_000,
                 model_persistence_threshold: int, comm_dtype: torch.dtype | None = None, op: str = "avg",
                 prescale: bool = False, predivide_factor: float = 1.0, dp_group=None, plan=None):
        self.module = module
        self.group = dp_group
        self.world_size = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        self.overlap_comm = overlap_comm
        self.reduce_bucket_size = reduce_bucket_size
        self._bucket: list[FlatParam] = []
        self._bucket_elems = 0
        self._inflight: list = []
        self.comm_dtype = comm_dtype
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        self.pre, self.post = reduction_factors(self.world_size, op, prescale, predivide_factor)
        self.hparams = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self.plan = plan
        master_device = _master_devices(plan, groups, device)
        self.flat: list[FlatParam] = []
        self.residency = Residency()
        self.uses: dict[int, list[FlatParam]] = {}  # id(module) -> flat params its forward needs
        owner_unit: dict[int, list[FlatParam]] = {}
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in group_of and id(p) not in owner_unit]
            by_group: dict[int, list[torch.nn.Parameter]] = {}
            for p in own:
                by_group.setdefault(group_of[id(p)], []).append(p)
            unit = []
            for gi, ps in by_group.items():
                fp = FlatParam(len(self.flat), ps, [_full_value(p) for p in ps], group_index=gi,
                               world_size=self.world_size, rank=self.rank, dtype=param_dtype, device=device,
                               dp_group=dp_group, residency=self.residency,
                               shard_device=plan.shard_device if plan is not None else device,
                               master_device=master_device(ps), pin=plan,
                               alias_master=plan is None or plan.param != "nvme")
                self.flat.append(fp)
                unit.append(fp)
                for p in ps:
                    registry.register(p, fp)
            for p in own:
                owner_unit[id(p)] = unit
        for m in module.modules():
            used = list(m.parameters(recurse=False)) + registry.externals(m)
            needed = {fp.index: fp for p in used if id(p) in owner_unit for fp in owner_unit[id(p)]}
            if needed:
                self.uses[id(m)] = list(needed.values())
        for p in module.parameters():
            if id(p) not in owner_unit and registry.owner_of(p) is not None:
                p.data = _full_value(p)  # frozen under zero.Init: stage 3 keeps frozen parameters whole
        self._mark_persistent(param_persistence_threshold, model_persistence_threshold)
        self._grads = {fp.index: _Grad() for fp in self.flat}
        self._slot = {id(p): (fp, s) for fp in self.flat for p, s in zip(fp.params, fp.bucket.segments)}
        # reduce-scatters launch in reverse creation order (roughly backward order), strictly in turn
        self._launch_order = list(reversed(self.flat))
        self._next = 0
        self.sub_groups = group_sub_groups([fp.bucket.chunk for fp in self.flat], sub_group_size)
        self.stepper = make_stepper(plan, [fp.master for fp in self.flat], self.sub_groups, self.rank)
        self.param_swapper = make_param_swapper(plan, self.flat, self.rank, param_dtype)
        self._recorded: list[int] = []
        self._recording: list[int] = []
        self._prefetching = False
        self._next_use: list[int] = []  # for each position of the recording: the unit's next position
        self._cum: list[int] = [0]  # prefix sums of padded sizes along the recording
        self._last_pos: dict[int, int] = {}  # flat parameter index -> its latest position this micro-step
        self._hooks = []
        for m in module.modules():
            if id(m) in self.uses:
                self._hooks += [m.register_forward_pre_hook(self._pre_forward),
                                m.register_forward_hook(self._post_forward),
                                m.register_full_backward_pre_hook(self._pre_backward)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for fp in self.flat for p in fp.params]
        self.reducing = False

    def _mark_persistent(self, threshold: int, model_cap: int) -> None:
        total = 0
        for fp in self.flat:
            if fp.numel <= threshold and total + fp.numel <= model_cap:
                fp.persistent = True
                total += fp.numel

    # -- gathering ---------------------------------------------------------------------------------
    def _fetch(self, fps: list[FlatParam]) -> None:
        start_gathers(fps)  # what this module needs now, as one collective
        for fp in fps:
            self._record(fp)
        self._prefetch()
        for fp in fps:
            fp.wait()

    def _record(self, fp: FlatParam) -> None:
        k = len(self._recording)
        self._recording.append(fp.index)
        self._last_pos[fp.index] = k
        if self._prefetching and (k >= len(self._recorded) or self._recorded[k] != fp.index):
            self._prefetching = False  # control flow changed: on demand for the rest of this micro-step

    def _prefetch(self) -> None:
        """Gather the next units of the recorded order ahead of use, as one collective, within budget."""
        if not self._prefetching:
            return
        in_flight, live = self.residency.gathering, self.residency.live
        ahead, chosen, window = [], set(), 0
        for idx in self._recorded[len(self._recording):]:
            nxt = self.flat[idx]
            window += nxt.padded  # look no further ahead than the prefetch budget, gathered or not
            if window > self.prefetch_bucket_size:
                break
            if nxt.state is not State.SHARDED or idx in chosen:
                continue
            if in_flight + nxt.padded > self.prefetch_bucket_size or live + nxt.padded > self.max_live:
                break
            ahead.append(nxt)
            chosen.add(idx)
            in_flight += nxt.padded
            live += nxt.padded
        start_gathers(ahead)

    def _release_unless_reused(self, fp: FlatParam) -> None:
        """Free `fp` after a use, unless the recorded order uses it again within
        `stage3_max_reuse_distance` elements of other gathers (and `max_live_parameters` allows)."""
        if fp.persistent:
            return
        k = self._last_pos.get(fp.index)
        if self._prefetching and k is not None and k < len(self._next_use):
            nxt = self._next_use[k]
            if nxt >= 0 and self._cum[nxt] - self._cum[k + 1] <= self.max_reuse_distance:
                if self.residency.live <= self.max_live:
                    return
        fp.release()

    def _pre_forward(self, module, args):
        self._fetch(self.uses[id(module)])

    def _post_forward(self, module, args, output):
        for fp in self.uses[id(module)]:
            self._release_unless_reused(fp)

    def _pre_backward(self, module, grad_output):
        self._fetch(self.uses[id(module)])

    # -- gradients ---------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        self.reducing = True  # like stage 2: every micro-step reduces
        self._next = 0
        for fp in self.flat:
            self._grads[fp.index].pending = len(fp.params)

    def start_micro_step(self) -> None:
        """Before a forward: start a new recording; prefetch from the previous one."""
        if self._recording:
            self._recorded = self._recording
            self._index_recording()
        self._recording = []
        self._last_pos = {}
        self._prefetching = bool(self._recorded)

    def _index_recording(self) -> None:
        """Next-use positions and prefix sizes of the recorded order (for the reuse distance)."""
        rec = self._recorded
        self._next_use = [-1] * len(rec)
        seen: dict[int, int] = {}
        for k in range(len(rec) - 1, -1, -1):
            self._next_use[k] = seen.get(rec[k], -1)
            seen[rec[k]] = k
        self._cum = [0]
        for idx in rec:
            self._cum.append(self._cum[-1] + self.flat[idx].padded)

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        fp, seg = self._slot[id(param)]
        g = self._grads[fp.index]
        if g.staging is None:
            g.staging = torch.zeros(fp.padded, dtype=self.comm_dtype or torch.float32, device=param.grad.device)
        g.staging[seg.offset:seg.offset + seg.numel].add_(param.grad.reshape(-1))
        param.grad = None
        g.pending -= 1
        if g.pending == 0:
            self._release_unless_reused(fp)  # every use in backward is done: its gradient is complete
        while self._next < len(self._launch_order) and self._grads[self._launch_order[self._next].index].pending <= 0:
            self._launch(self._launch_order[self._next])
            self._next += 1

    def _launch(self, fp: FlatParam) -> None:
        """Queue `fp`'s gradient; reduce-scatter the queue as one collective once it holds
        `reduce_bucket_size` elements (or at the end of backward)."""
        self._bucket.append(fp)
        self._bucket_elems += fp.padded
        if self._bucket_elems >= self.reduce_bucket_size:
            self._flush()

    def _flush(self) -> None:
        fps, self._bucket, self._bucket_elems = self._bucket, [], 0
        if not fps:
            return
        dtype = self.comm_dtype or torch.float32
        device = fps[0].device
        for fp in fps:
            g = self._grads[fp.index]
            if g.staging is None:  # no gradient reached it here (unused); it still takes part
                g.staging = torch.zeros(fp.padded, dtype=dtype, device=device)
        if len(fps) == 1:
            send = self._grads[fps[0].index].staging
        else:  # rank-major: rank r's chunk of every flat parameter, then rank r + 1's
            send = torch.cat([self._grads[fp.index].staging.view(self.world_size, -1) for fp in fps], dim=1)
            send = send.reshape(-1)
        if self.pre != 1.0:
            send.mul_(self.pre)
        out = torch.empty(sum(fp.bucket.chunk for fp in fps), dtype=send.dtype, device=device)
        handle = comm.reduce_scatter_tensor(out, send, op="sum", group=self.group, async_op=True)
        for fp in fps:
            self._grads[fp.index].staging = None
        self._inflight.append((fps, out, handle))
        if not self.overlap_comm:
            self._complete_all()
        elif len(self._inflight) > MAX_IN_FLIGHT_BUCKETS:  # Note [bounded in-flight buckets]
            self._complete_oldest()

    @torch.no_grad()
    def _complete_all(self) -> None:
        while self._inflight:
            self._complete_oldest()

    @torch.no_grad()
    def _complete_oldest(self) -> None:
        for fps, out, handle in [self._inflight.pop(0)]:
            handle.wait()
            if self.post != 1.0:
                out.mul_(self.post)
            offset = 0
            for fp in fps:
                part = out[offset:offset + fp.bucket.chunk]
                fp.grad_shard.add_(part if part.device == fp.grad_shard.device else part.to(fp.grad_shard.device))
                offset += fp.bucket.chunk

    def end_micro_step(self) -> None:
        self.finish_reduction()
        for fp in self.flat:  # anything gathered for backward but unused (frozen paths, branches)
            if not fp.persistent and fp.state is not State.SHARDED:
                fp.release()

    def finish_reduction(self) -> None:
        if not self.reducing:
            return
        while self._next < len(self._launch_order):
            self._launch(self._launch_order[self._next])
            self._next += 1
        self._flush()
        self._complete_all()
        self.reducing = False

    # -- optimizer ---------------------------------------------------------------------------------
    def optimizer_param_groups(self) -> list[dict]:
        return [{**h, "params": [fp.master for fp in self.flat if fp.group_index == gi]}
                for gi, h in enumerate(self.hparams)]

    def retarget(self, optimizer: torch.optim.Optimizer) -> None:
        if len(optimizer.param_groups) != len(self.hparams):
            raise ValueError("client optimizer param groups do not match the groups zerospeed partitioned")
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [fp.master for fp in self.flat if fp.group_index == gi]

    def global_grad_norm(self) -> float:
        """L2 norm of the full gradient: local chunks' squared norms (on the device), all-reduced once."""
        return sharded_global_norm([fp.grad_shard for fp in self.flat], self.group)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        self.stepper.step(optimizer, [(fp.master, fp.grad_shard) for fp in self.flat], coef, self.sub_groups,
                          on_stepped=self._publish)
        for fp in self.flat:
            if fp.state is not State.SHARDED:  # any resident copy is stale now
                fp.release()
                if fp.persistent:
                    fp.wait()  # refresh the always-resident copy

    def _publish(self, indices: list[int]) -> None:
        """Updated masters into the parameter shards while they are resident (NVMe: written back)."""
        if self.param_swapper is not None:  # one batched write of the sub-group's shards
            fps = [self.flat[i] for i in sorted(indices)]
            self.param_swapper.write_shards(fps, [fp.master for fp in fps])
            return
        for i in indices:
            self.flat[i].shard_from_master()

    def resident(self, optimizer):
        """Context in which every master and optimizer state is in memory (checkpoint save/load)."""
        return self.stepper.resident(optimizer)

    def placement(self) -> dict[str, str]:
        """Where each kind of model state lives: read off the tensors, the stepper and the swapper."""
        out = state_placement(self.plan, params=[fp.shard for fp in self.flat if fp.shard is not None],
                              grads=[fp.grad_shard for fp in self.flat], stepper=self.stepper)
        if self.param_swapper is not None:
            out["parameters"] = f"nvme:{self.plan.param_nvme}"
        masters = sorted({str(fp.master.device) for fp in self.flat}) if self.stepper.kind != "nvme" else []
        if len(masters) > 1:  # a partial offload (ratio < 1)
            out["master_weights"] = out["optimizer_states"] = ",".join(masters)
        return out

    def swap_files(self) -> list:
        """(kind, path, bytes) of every NVMe swap file this rank owns."""
        return self.stepper.files() + (self.param_swapper.files() if self.param_swapper is not None else [])

    def zero_grads(self) -> None:
        for fp in self.flat:
            fp.grad_shard.zero_()

    # -- checkpoints and introspection -------------------------------------------------------------
    def shard_entries(self, names: dict[int, str]) -> list[ShardEntry]:
        return [ShardEntry(fp.master, [Piece(names[id(fp.params[s.param])], s.param_offset, s.offset, s.numel)
                                       for s in fp.bucket.rank_segments(self.rank)]) for fp in self.flat]

    def sync_params_from_masters(self) -> None:
        for fp in self.flat:
            fp.shard_from_master()
            if fp.state is not State.SHARDED:
                fp.release()
                if fp.persistent:
                    fp.wait()

    def load_masters_from_params(self) -> None:
        """Nothing to do: at stage 3 the module holds no values for sharded parameters (a checkpoint
        load fills the masters from its shards, then `sync_params_from_masters`)."""

    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The full module state dict on rank 0 (others get {}), gathered one flat parameter at a time."""
        out = {}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for fp in self.flat:
            was = fp.state
            fp.wait()
            if self.rank == 0:
                for p in fp.params:
                    out[names[id(p)]] = p.detach().to(dtype or p.dtype).cpu().clone()
            if was is State.SHARDED:
                fp.release()
        if self.rank == 0:
            sharded = {id(p) for fp in self.flat for p in fp.params}
            for n, t in self.module.state_dict(keep_vars=True).items():
                if n not in out and id(t) not in sharded:
                    out[n] = t.detach().cpu().clone()
            tied = {n: names[id(p)] for n, p in self.module.named_parameters(remove_duplicate=False)}
            for n, first in tied.items():
                out.setdefault(n, out[first])
        return out if self.rank == 0 else {}

    def memory_breakdown(self, optimizer) -> dict[str, int]:
        params = sum((fp.shard.nbytes if fp.shard is not None else 0) + (fp.full.nbytes if fp.full is not None else 0)
                     for fp in self.flat)
        masters = sum(fp.master.nbytes for fp in self.flat
                      if fp.shard is None or fp.master.data_ptr() != fp.shard.data_ptr())
        return {"parameters": params, "gradients": sum(fp.grad_shard.nbytes for fp in self.flat),
                "master_weights": masters, "optimizer_states": optimizer_state_bytes(optimizer)}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Remove the swap files (also done at exit)."""
        self.stepper.close()
        if self.param_swapper is not None:
            self.param_swapper.close()


def _full_value(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's full value: gathered from its zero.Init shards if it already has an owner."""
    owner = registry.owner_of(p)
    if owner is None:
        return p.detach()
    owner.wait()
    i = next(i for i, q in enumerate(owner.params) if q is p)
    return owner.full[owner.bucket.segments[i].offset:][:owner.bucket.segments[i].numel].view(owner.shapes[i]).clone()


def _master_devices(plan, groups: list[dict], device: torch.device):
    """Where each unit's fp32 master goes: the host when offloaded; with `ratio` < 1 only the first
    `ratio` of the parameters (in registration order) are offloaded, the rest stay on the device."""
    if plan is None or plan.optimizer == "none":
        return lambda params: device
    if plan.ratio >= 1.0:
        return lambda params: HOST
    order = [p for g in groups for p in g["params"]]
    budget = plan.ratio * sum(p.numel() for p in order)
    offloaded, seen = set(), 0
    for p in order:
        seen += p.numel()
        if seen <= budget:
            offloaded.add(id(p))
    return lambda params: HOST if id(params[0]) in offloaded else device
