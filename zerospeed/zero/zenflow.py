"""ZenFlow at ZeRO stages 1-3 with the optimizer offloaded to the host (`zero_optimization.zenflow`).

The plan, the column choice, the "auto" interval and the host thread are `zerospeed.offload.zenflow`;
this module drives them over the strategies' flat chunks. `ZenFlowStage1` / `ZenFlowStage2` /
`ZenFlowStage3` are those stages with the optimizer step replaced; reduction, norms and clipping are
unchanged.

Note [the ZenFlow step]: the reduced gradient g of optimizer step t (clipped and unscaled) is used so:
  1. t < full_warm_up_rounds: an ordinary offloaded step of everything (host masters -> parameters).
  2. At the start of an interval, if no columns are selected yet or `select_interval` steps have passed
     since the last selection: select, for every matrix, the top `topk_ratio` columns by the L1 norm of
     their column of g (vectors: wholly selected), and start the selected columns' AdamW afresh.
  3. The selected columns of the parameters are stepped by that AdamW with g's selected columns (the
     engine's lr, betas, eps and weight decay of the parameter's group, decoupled decay as DeepSpeed's
     selective AdamW); every rank holds the full selected gradient and does the same step on its whole
     copy of the parameters, so nothing is gathered afterwards.
  4. g (all of it) is added to the host accumulator; the interval counts one more step.
  5. At the end of an interval (`update_interval` steps, or Note [auto update interval]) the host
     optimizer steps each master chunk with the interval's mean gradient. Publishing a host result
     means: the unselected elements of this rank's parameter chunk take the master's values, the
     selected ones keep the device's and are copied into the master, and the chunks are all-gathered.
     Without `overlap_step` the result is published at once; with it, the step runs in a background
     thread (Note [ZenFlow's host thread]) and the result is published at the end of the *next*
     interval, just before that interval's host step is started.
DeepSpeed differs in bookkeeping, not in this rule: it makes every micro-step a ZenFlow step (it sets
gradient_accumulation_steps to update_interval), its selection may fall inside an interval, and it
keeps the selective AdamW's step count across re-selections; here a ZenFlow step is an optimizer step
(gradient accumulation keeps its meaning), selections happen at interval starts, and the selected
columns' AdamW restarts with each selection.

Note [ZenFlow at stage 3]: the same rule over the parameter shards. The column choice is stage 1/2's:
each rank adds its gradient chunk into per-column L1 sums (a column's elements may lie in several ranks'
chunks: each adds its part) and one all-reduce gives every rank the whole columns' norms, so every
column counts and k = int(topk_ratio * columns). The selected columns are stepped where they live: each
rank's selective AdamW steps the selected elements of its own shard with its own reduced gradient (no
gather of the selected gradient; its moments are partitioned like the shards); AdamW is elementwise, so
this is the whole columns' step. Publishing a host result writes the shards (unselected elements from the
masters); after any write the resident full copies (persistent units) are released and gathered again.
DeepSpeed's stage 3 selects differently: it stores each matrix transposed (its `ds_shape`), cuts each
parameter alone across the ranks, and each rank scores only the columns wholly inside its partition, so a
column cut by a partition boundary is never selected, and k = max(1, int(ratio * those whole columns)).
Parameter shards on NVMe are refused (the write would go through the swap file every step).

Note [ZenFlow's host thread]: the host step reads and writes only the masters, the optimizer states and
an accumulator the training thread no longer writes (two accumulators alternate), so the forward and
backward of the following steps run beside it; torch releases the GIL inside its kernels. It steps a
snapshot of the optimizer (`snapshot_optimizer`, optim/sub_group_step.py: its param groups copied at
submission, its attributes and hooks kept): the LR scheduler writing the engine's groups meanwhile does
not change the running step's lr. A checkpoint save or load, and the next interval's end, wait for it.

Note [ZenFlow masters]: in fp32 on a CPU-only machine offloaded masters would alias the parameter
chunks (zero/flat_group.py); ZenFlow needs them apart (the host result is not published at once, and
the selected columns run ahead of it), so it gives them their own storage.

Note [ZenFlow in checkpoints]: everything ZenFlow adds is saved as optimizer state of each master while
a checkpoint is written (`resident`), so it is cut, saved and resharded like Adam's moments: the host
accumulator, the published weights of this rank's chunk, the selection as a 0/1 mask over the chunk,
the selected columns' moments scattered to their elements, and the counters (a small dict). A load
rebuilds the selection from the masks and the moments from the scattered values (a sum over the ranks)
and puts the published weights back into the parameters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zerospeed import comm
from zerospeed.offload.plan import HOST
from zerospeed.offload.zenflow import AutoInterval, HostStepWorker, ZenFlowPlan, matrix_shape, top_columns
from zerospeed.optim.sub_group_step import snapshot_optimizer, step_in_sub_groups
from zerospeed.zero.sharded import ShardedStrategy, Stage2Strategy
from zerospeed.zero.stage3.strategy import Stage3Strategy

_KEYS = ("zenflow_acc", "zenflow_weights", "zenflow_selected", "zenflow_exp_avg", "zenflow_exp_avg_sq")
_COUNTERS = "zenflow_counters"


@dataclass
class _Matrix:
    """One parameter of a unit seen as a matrix, and its selected columns."""

    param: torch.Tensor
    rows: int
    cols: int
    whole: bool
    col_offset: int  # where its columns start in the unit's column vector
    selected: torch.Tensor | None = None  # column indices, ascending
    buf_offset: int = 0  # where its selected block [rows, k] starts in the unit's selected buffer
    slice: torch.Tensor | None = None  # the selective AdamW's copy of the selected block

    @property
    def k(self) -> int:
        return self.selected.numel()


@dataclass
class _UnitSelection:
    matrices: dict[int, _Matrix]  # by the parameter's index in the unit's parameter list
    size: int  # elements of the selected buffer
    src: torch.Tensor  # positions of selected elements in this rank's chunk
    dst: torch.Tensor  # their positions in the selected buffer


def add_column_sums(sums: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Add `values` — the elements [start, start + len) of a row-major matrix with len(sums) columns —
    into `sums` by column: whole rows at once, the partial first and last rows by slices."""
    cols, n = sums.numel(), values.numel()
    head = min(n, (-start) % cols)
    lead = start % cols
    sums[lead : lead + head] += values[:head]
    rows = (n - head) // cols
    if rows:
        sums += values[head : head + rows * cols].view(rows, cols).sum(dim=0)
    tail = n - head - rows * cols
    sums[:tail] += values[n - tail :]


class ZenFlowMixin:
    """Note [the ZenFlow step] over a stage-1/2 strategy (`ShardedStrategy` state: units, masters, flat)."""

    def _init_zenflow(self, zf: ZenFlowPlan) -> None:
        self.zf = zf
        self._separate_masters()
        self._acc = [torch.zeros_like(m) for m in self.masters]
        self._spare = [torch.zeros_like(m) for m in self.masters] if zf.overlap_step else None
        self._sel_device = HOST if zf.offload else self.device
        self._worker = HostStepWorker()
        self._reset_zenflow()

    def _reset_zenflow(self) -> None:
        self._t = 0  # ZenFlow (optimizer) steps taken
        self._n = 0  # steps in the current interval
        self._since_select = 0
        self._sel: list[_UnitSelection] | None = None
        self._sel_opt: torch.optim.AdamW | None = None
        self._pending = False  # the masters hold a host result not yet published
        n_matrices = sum(
            not matrix_shape(self._full_shape(u.params[s.param]))[2] for u in self.units for s in u.layout.segments
        )
        self._auto = AutoInterval(n_matrices, self.zf.topk_ratio, self.zf.auto_ratio) if self.zf.auto_update else None
        for a in self._acc:
            a.zero_()

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        """Note [the ZenFlow step]."""
        if self.local_gradients():
            raise RuntimeError(
                "ZenFlow steps reduced gradients: no_sync() boundaries and 1-bit optimizers are not supported"
            )
        grads = [u.result for u in self.units]
        if coef != 1.0:
            for g in grads:
                g.mul_(coef)
        if self._t < self.zf.full_warm_up_rounds:
            step_in_sub_groups(optimizer, list(zip(self.masters, grads)), 1.0, self.sub_groups)
            self._plain_publish()
            self._t += 1
            return
        if self._n == 0 and (
            self._sel is None or (self.zf.select_interval > 0 and self._since_select >= self.zf.select_interval)
        ):
            self._select([self._column_sums(k, g.abs()) for k, g in enumerate(grads)], optimizer)
        selected = [self._selected_grads(k, g) for k, g in enumerate(grads)]
        self._device_step(selected, optimizer)
        for a, g in zip(self._acc, grads):
            a.add_(g)
        self._n += 1
        self._since_select += 1
        self._t += 1
        ends = self._auto.observe(*self._l1_sums(grads, selected)) if self._auto else self._n == self.zf.update_interval
        if ends:
            self._end_interval(optimizer)

    def _end_interval(self, optimizer) -> None:
        n, self._n = self._n, 0
        if self._auto is not None:
            self._auto.reset()
        if not self.zf.overlap_step:
            self._host_step(optimizer, self._acc, n)
            self._publish_host_result()
            return
        self._worker.wait()
        if self._pending:
            self._publish_host_result()
        acc, self._acc = self._acc, self._spare
        self._spare = acc
        for a in self._acc:
            a.zero_()
        host = snapshot_optimizer(optimizer)  # Note [ZenFlow's host thread]
        self._pending = True
        self._worker.submit(lambda: self._host_step(host, acc, n))

    def _host_step(self, optimizer, acc: list[torch.Tensor], n: int) -> None:
        step_in_sub_groups(optimizer, list(zip(self.masters, acc)), 1.0 / n, self.sub_groups)
        if not self.zf.overlap_step:
            for a in acc:
                a.zero_()

    @torch.no_grad()
    def _publish_host_result(self) -> None:
        """Unselected elements from the masters, selected ones from the device (and into the masters)."""
        for k, sel in enumerate(self._sel):
            master = self.masters[k]
            kept = self._weights(k)[sel.src].clone()
            merged = master.to(kept.dtype, copy=True)
            merged[sel.src] = kept.to(merged.device)
            self._set_weights(k, merged)
            master[sel.src] = kept.to(master.device, master.dtype)
        self._weights_changed()
        self._pending = False

    # -- stage 1/2's layout (ZenFlowStage3 overrides these) -------------------------------------------
    def _separate_masters(self) -> None:
        """Note [ZenFlow masters]; `self.masters` and each unit's engine param group."""
        for fg in self.flat:
            for i, (master, buffer) in enumerate(zip(fg.masters, fg.param_buffers)):
                if master.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    fg.masters[i] = torch.nn.Parameter(master.detach().clone())
        self.masters = [fg.masters[i] for fg, i in self._entries]
        self._group_of = [next(g for g, f in enumerate(self.flat) if f is fg) for fg, _ in self._entries]

    def _weights(self, k: int) -> torch.Tensor:
        """This rank's chunk of unit k's weights (what the model computes with)."""
        fg, i = self._entries[k]
        return fg.chunk(fg.layouts[i], fg.param_buffers[i])

    def _set_weights(self, k: int, values: torch.Tensor) -> None:
        self._weights(k).copy_(values)

    def _weights_changed(self) -> None:
        """Every rank's chunks written: the whole parameters follow."""
        self._all_gather_params()

    def _plain_publish(self) -> None:
        """After an ordinary step of the masters: the parameters follow."""
        ShardedStrategy.sync_params_from_masters(self)

    def _selected_grads(self, k: int, g: torch.Tensor) -> torch.Tensor:
        return self._gather_selected(k, g)

    # -- selection -----------------------------------------------------------------------------------
    def _matrices(self, k: int) -> tuple[dict[int, _Matrix], int]:
        """Unit k's parameters as matrices, by their index in the unit's parameter list (layout order),
        and the number of columns of all its matrices together."""
        out, cols = {}, 0
        for s in self.units[k].layout.segments:
            p = self.units[k].params[s.param]
            rows, n_cols, whole = matrix_shape(self._full_shape(p))
            out[s.param] = _Matrix(p, rows, n_cols, whole, cols)
            cols += 0 if whole else n_cols
        return out, cols

    def _column_sums(self, k: int, values: torch.Tensor) -> torch.Tensor:
        """Per column of every matrix of unit k: the sum of `values` (this rank's chunk) over the whole
        column, fp64 (summed over the unit's ranks: each holds a piece of the column)."""
        u = self.units[k]
        matrices, n_cols = self._matrices(k)
        sums = torch.zeros(n_cols, dtype=torch.float64, device=values.device)
        for piece in u.layout.rank_segments(u.rank):
            m = matrices[piece.param]
            if not m.whole:
                cols = sums[m.col_offset : m.col_offset + m.cols]
                add_column_sums(cols, values[piece.offset : piece.offset + piece.numel].double(), piece.param_offset)
        return self._sum_over(u, sums)

    def _sum_over(self, u, t: torch.Tensor) -> torch.Tensor:
        comm_device = self.device
        out = t.to(comm_device)
        comm.all_reduce(out, op="sum", group=u.group)
        return out.to(t.device)

    def _select(self, column_sums: list[torch.Tensor], optimizer, masks: bool = False) -> None:
        """Choose the columns (the top ones by `column_sums`, or — `masks` — those whose sum is positive)
        and start the selected columns' AdamW afresh."""
        self._sel = []
        for k, sums in enumerate(column_sums):
            matrices, _ = self._matrices(k)
            size = 0
            for m in matrices.values():
                if m.whole:
                    m.selected = torch.arange(m.cols)
                else:
                    col = sums[m.col_offset : m.col_offset + m.cols]
                    m.selected = (col > 0).nonzero().flatten() if masks else top_columns(col, self.zf.topk_ratio)
                    m.selected = m.selected.cpu()
                m.buf_offset = size
                size += m.rows * m.k
            src, dst = self._positions(k, matrices)
            self._sel.append(_UnitSelection(matrices, size, src, dst))
        self._since_select = 0
        self._build_selective_optimizer(optimizer)

    def _positions(self, k: int, matrices: dict[int, _Matrix]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk positions, selected-buffer positions) of this rank's selected elements of unit k."""
        u = self.units[k]
        src, dst = [], []
        for piece in u.layout.rank_segments(u.rank):
            m = matrices[piece.param]
            # the selected elements' flat indices in the parameter, row by row: [rows, k] (k << columns)
            flat = torch.arange(m.rows).unsqueeze(1) * m.cols + m.selected.unsqueeze(0)
            inside = (flat >= piece.param_offset) & (flat < piece.param_offset + piece.numel)
            src.append(piece.offset + flat[inside] - piece.param_offset)
            dst.append(m.buf_offset + inside.flatten().nonzero().flatten())
        empty = torch.zeros(0, dtype=torch.long)
        device = self.units[k].result.device
        return (torch.cat(src) if src else empty).to(device), (torch.cat(dst) if dst else empty).to(device)

    def _build_selective_optimizer(self, optimizer) -> None:
        groups: dict[int, list[torch.Tensor]] = {}
        for k, sel in enumerate(self._sel):
            for m in sel.matrices.values():
                m.slice = None
                if m.k:
                    m.slice = torch.zeros(m.rows, m.k, dtype=self.masters[k].dtype, device=self._sel_device)
                    groups.setdefault(self._group_of[k], []).append(m.slice)
        self._sel_opt = torch.optim.AdamW(
            [{"params": ps, "engine_group": g} for g, ps in groups.items()] or [{"params": [torch.zeros(0)]}],
            foreach=False,
        )
        self._sync_hyperparameters(optimizer)

    def _sync_hyperparameters(self, optimizer) -> None:
        for group in self._sel_opt.param_groups:
            if "engine_group" not in group:
                continue
            src = optimizer.param_groups[group["engine_group"]]
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key not in src:
                    raise ValueError(f"ZenFlow's selective AdamW needs the optimizer's {key!r}: use Adam or AdamW")
                group[key] = src[key]

    # -- the device step -----------------------------------------------------------------------------
    def _gather_selected(self, k: int, values: torch.Tensor) -> torch.Tensor:
        """Unit k's selected elements of `values` (chunks), whole on every rank (disjoint pieces summed)."""
        sel = self._sel[k]
        buf = torch.zeros(sel.size, dtype=values.dtype, device=values.device)
        buf[sel.dst] = values[sel.src]
        return self._sum_over(self.units[k], buf)

    def _device_step(self, selected: list[torch.Tensor], optimizer) -> None:
        self._sync_hyperparameters(optimizer)
        views = []
        for sel, buf in zip(self._sel, selected):
            for m in sel.matrices.values():
                if not m.k:
                    continue
                w = m.param.data.view(m.rows, m.cols)
                m.slice.copy_(w[:, m.selected])
                m.slice.grad = buf[m.buf_offset : m.buf_offset + m.rows * m.k].view(m.rows, m.k).to(m.slice)
                views.append((w, m))
        self._sel_opt.step()
        for w, m in views:
            w[:, m.selected] = m.slice.to(w.dtype)
            m.slice.grad = None

    def _l1_sums(self, grads, selected) -> tuple[list[float], list[float]]:
        """Per matrix (units, then segments): the selected columns' and the whole gradient's L1 norms."""
        sel_l1, total_l1 = [], []
        for k, (g, buf) in enumerate(zip(grads, selected)):
            u = self.units[k]
            matrices = self._sel[k].matrices
            order = {index: i for i, index in enumerate(matrices)}
            partial = torch.zeros(len(matrices), dtype=torch.float64, device=g.device)
            for piece in u.layout.rank_segments(u.rank):
                partial[order[piece.param]] += g[piece.offset : piece.offset + piece.numel].abs().double().sum()
            total = self._sum_over(u, partial).tolist()
            for i, m in enumerate(matrices.values()):
                if not m.whole:
                    sel_l1.append(float(buf[m.buf_offset : m.buf_offset + m.rows * m.k].abs().double().sum()))
                    total_l1.append(total[i])
        return sel_l1, total_l1

    # -- checkpoints (Note [ZenFlow in checkpoints]) ---------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer):
        self._worker.wait()
        if optimizer is not None:
            self._stash(optimizer)
        try:
            with super().resident(optimizer):
                yield
        finally:
            if optimizer is not None:
                self._unstash(optimizer)

    def _scatter(self, k: int, block: torch.Tensor) -> torch.Tensor:
        """Unit k's selected-buffer values at their elements of this rank's chunk (zeros elsewhere)."""
        sel, master = self._sel[k], self.masters[k]
        out = torch.zeros_like(master)
        out[sel.src] = block[sel.dst].to(out)
        return out

    @torch.no_grad()
    def _stash(self, optimizer) -> None:
        step = 0
        for k, master in enumerate(self.masters):
            state = optimizer.state[master]
            state["zenflow_acc"] = self._acc[k]
            state["zenflow_weights"] = self._weights(k).to(master.dtype, copy=True)
            moments = {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
            mask = torch.zeros_like(master)
            if self._sel is not None:
                mask[self._sel[k].src] = 1.0
                moments, step = self._selected_moments(k, step)
            state["zenflow_selected"] = mask
            state["zenflow_exp_avg"], state["zenflow_exp_avg_sq"] = moments["exp_avg"], moments["exp_avg_sq"]
        counters = {
            "t": self._t,
            "n": self._n,
            "since_select": self._since_select,
            "selected": self._sel is not None,
            "pending": self._pending,
            "selective_step": step,
            "auto": self._auto.state_dict() if self._auto is not None else None,
        }
        for master in self.masters:
            optimizer.state[master][_COUNTERS] = dict(counters)

    def _selected_moments(self, k: int, step: int) -> tuple[dict[str, torch.Tensor], int]:
        """Unit k's selected moments scattered over this rank's chunk, and the selective step count."""
        sel, master = self._sel[k], self.masters[k]
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            block = torch.zeros(sel.size, dtype=master.dtype, device=self._sel_device)
            for m in sel.matrices.values():
                st = self._sel_opt.state.get(m.slice) if m.slice is not None else None
                if st:
                    block[m.buf_offset : m.buf_offset + m.rows * m.k] = st[key].reshape(-1)
                    step = int(st["step"])
            moments[key] = self._scatter(k, block.to(master.device))
        return moments, step

    def _unstash(self, optimizer) -> None:
        for master in self.masters:
            state = optimizer.state.get(master)
            if state is None:
                continue
            for key in (*_KEYS, _COUNTERS):
                state.pop(key, None)
            if not state:
                del optimizer.state[master]

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        """After a checkpoint load: ZenFlow's saved state back (the published weights into the
        parameters), or — a checkpoint without it — the plain refresh and a fresh ZenFlow."""
        optimizer = self.bound_optimizer if isinstance(self.bound_optimizer, torch.optim.Optimizer) else None
        states = [optimizer.state.get(m, {}) if optimizer is not None else {} for m in self.masters]
        if not states or not all(_COUNTERS in s and "zenflow_weights" in s for s in states):
            self._reset_zenflow()
            super().sync_params_from_masters()
            return
        counters = states[0][_COUNTERS]
        for k, state in enumerate(states):
            self._set_weights(k, state["zenflow_weights"].to(self._weights(k).dtype))
            self._acc[k].copy_(state["zenflow_acc"])
        self._weights_changed()
        self._t, self._n = int(counters["t"]), int(counters["n"])
        self._pending = bool(counters["pending"])
        if self._auto is not None and counters.get("auto"):
            self._auto.load_state_dict(counters["auto"])
        self._sel = None
        if counters["selected"]:
            self._select([self._column_sums(k, s["zenflow_selected"]) for k, s in enumerate(states)], optimizer, True)
            for k, state in enumerate(states):
                self._load_moments(k, state, int(counters["selective_step"]))
        self._since_select = int(counters["since_select"])

    def _load_moments(self, k: int, state: dict, step: int) -> None:
        """Unit k's selective AdamW state from its moments scattered over the chunks (collective)."""
        blocks = {key: self._gather_selected(k, state["zenflow_" + key]) for key in ("exp_avg", "exp_avg_sq")}
        for m in self._sel[k].matrices.values():
            if m.slice is None:
                continue
            at = slice(m.buf_offset, m.buf_offset + m.rows * m.k)
            self._sel_opt.state[m.slice] = {
                "step": torch.tensor(float(step)),
                **{key: b[at].view(m.rows, m.k).to(m.slice).clone() for key, b in blocks.items()},
            }


class ZenFlowStage1(ZenFlowMixin, ShardedStrategy):
    """ZeRO stage 1 with ZenFlow's step (Note [the ZenFlow step])."""

    def __init__(self, *args, zenflow: ZenFlowPlan, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_zenflow(zenflow)


class ZenFlowStage2(ZenFlowMixin, Stage2Strategy):
    """ZeRO stage 2 with ZenFlow's step (Note [the ZenFlow step])."""

    def __init__(self, *args, zenflow: ZenFlowPlan, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_zenflow(zenflow)


class ZenFlowStage3(ZenFlowMixin, Stage3Strategy):
    """ZeRO stage 3 with ZenFlow's step: Note [ZenFlow at stage 3]."""

    def __init__(self, *args, zenflow: ZenFlowPlan, **kwargs):
        super().__init__(*args, **kwargs)
        if self.param_swapper is not None:
            raise ValueError("ZenFlow at stage 3 steps the parameter shards in memory: offload_param nvme is refused")
        self._init_zenflow(zenflow)

    # -- the layout: parameter shards --------------------------------------------------------------
    def _separate_masters(self) -> None:
        for fp in self.trained:  # Note [ZenFlow masters]: fp32 masters alias the shards where both are on the host
            if fp.master.untyped_storage().data_ptr() == fp.shard.untyped_storage().data_ptr():
                fp.master = torch.nn.Parameter(fp.master.detach().clone())
        self.masters = [fp.master for fp in self.trained]
        self._group_of = [fp.group_index for fp in self.trained]
        self._slices: list[torch.Tensor | None] = [None] * len(self.trained)
        self._which: list[torch.Tensor] = []

    def _weights(self, k: int) -> torch.Tensor:
        return self.trained[k].shard

    def _set_weights(self, k: int, values: torch.Tensor) -> None:
        self.trained[k].write_shard(values)

    def _weights_changed(self) -> None:
        self._refresh_resident()  # resident full copies (persistent units) are gathered again

    def _plain_publish(self) -> None:
        Stage3Strategy.sync_params_from_masters(self)

    def _selected_grads(self, k: int, g: torch.Tensor) -> torch.Tensor:
        return g[self._sel[k].src]  # this rank's selected elements only

    # -- the selective AdamW over this rank's selected elements ----------------------------------------
    def _build_selective_optimizer(self, optimizer) -> None:
        groups: dict[int, list[torch.Tensor]] = {}
        self._which = []
        for k, sel in enumerate(self._sel):
            n = sel.src.numel()
            self._slices[k] = torch.zeros(n, dtype=self.masters[k].dtype, device=self._sel_device) if n else None
            if n:
                groups.setdefault(self._group_of[k], []).append(self._slices[k])
            # each selected element's matrix (its index in sel.matrices), for the "auto" interval's sums
            u = self.units[k]
            pieces = u.layout.rank_segments(u.rank)
            order = {index: i for i, index in enumerate(sel.matrices)}
            ends = torch.tensor([p.offset + p.numel for p in pieces], dtype=torch.long, device=sel.src.device)
            owner = torch.tensor([order[p.param] for p in pieces], dtype=torch.long, device=sel.src.device)
            self._which.append(owner[torch.bucketize(sel.src, ends, right=True)] if n else sel.src)
        self._sel_opt = torch.optim.AdamW(
            [{"params": ps, "engine_group": g} for g, ps in groups.items()] or [{"params": [torch.zeros(0)]}],
            foreach=False,
        )
        self._sync_hyperparameters(optimizer)

    def _device_step(self, selected: list[torch.Tensor], optimizer) -> None:
        self._sync_hyperparameters(optimizer)
        stepped = []
        for k, (sel, g) in enumerate(zip(self._sel, selected)):
            s = self._slices[k]
            if s is not None:
                s.copy_(self._weights(k)[sel.src])
                s.grad = g.to(s)
                stepped.append(k)
        self._sel_opt.step()
        for k in stepped:
            self.trained[k].write_shard(self._slices[k], self._sel[k].src)
            self._slices[k].grad = None
        self._refresh_resident()

    def _l1_sums(self, grads, selected) -> tuple[list[float], list[float]]:
        sel_l1, total_l1 = [], []
        for k, (g, gs) in enumerate(zip(grads, selected)):
            u, matrices = self.units[k], self._sel[k].matrices
            order = {index: i for i, index in enumerate(matrices)}
            partial = torch.zeros(2, len(matrices), dtype=torch.float64, device=g.device)
            for piece in u.layout.rank_segments(u.rank):
                partial[0, order[piece.param]] += g[piece.offset : piece.offset + piece.numel].abs().double().sum()
            if gs.numel():
                partial[1].index_add_(0, self._which[k], gs.abs().double())
            total, sel = self._sum_over(u, partial).tolist()
            for i, m in enumerate(matrices.values()):
                if not m.whole:
                    sel_l1.append(sel[i])
                    total_l1.append(total[i])
        return sel_l1, total_l1

    # -- checkpoints ---------------------------------------------------------------------------------
    def _selected_moments(self, k: int, step: int) -> tuple[dict[str, torch.Tensor], int]:
        master, s = self.masters[k], self._slices[k]
        st = self._sel_opt.state.get(s) if s is not None else None
        moments = {key: torch.zeros_like(master) for key in ("exp_avg", "exp_avg_sq")}
        for key in moments if st else ():
            moments[key][self._sel[k].src] = st[key].to(master)
        return moments, self._since_select  # every ZenFlow step since the selection stepped the selected AdamW

    def _load_moments(self, k: int, state: dict, step: int) -> None:
        s = self._slices[k]
        if s is not None:
            src = self._sel[k].src
            self._sel_opt.state[s] = {
                "step": torch.tensor(float(step)),
                **{key: state["zenflow_" + key][src].to(s).clone() for key in ("exp_avg", "exp_avg_sq")},
            }
