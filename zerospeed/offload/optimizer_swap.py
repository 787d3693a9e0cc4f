"""ZeRO-Infinity optimizer offload: fp32 masters and optimizer states live in NVMe swap files.

Memory holds only the fp32 gradient shards and a fixed set of host buffers, each the size of the
largest sub-group (`sub_group_size`): one set for the sub-group being stepped, one more with
`pipeline_read` (the next sub-group is read while this one steps) and one more with
`pipeline_write` (the previous one is written while this one steps). Per sub-group and per kind
(master, then each elementwise optimizer state such as Adam's exp_avg / exp_avg_sq) the values sit
contiguously in a buffer, so each read and write is one large aligned request.

Note [swapping torch optimizer state]: torch optimizers keep per-parameter state in
`optimizer.state[param]` and update it in place. For a sub-group's step we point each master's
`.data` and each of its elementwise state tensors at views of the host buffers; afterwards we point
them at an empty tensor again. Scalar state (Adam's `step`) stays in memory. States are created by
the optimizer itself on its first step (any elementwise optimizer works); they are written out
right after, which creates one swap file per state name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from zerospeed.offload.aio import DIRECT_ALIGN, AsyncIO
from zerospeed.offload.swap import BufferPool, SwapFile
from zerospeed.optim.sub_group_step import OnStepped, scale_grads, step_one

logger = logging.getLogger(__name__)

MASTER = "fp32"
_EMPTY = torch.empty(0, dtype=torch.float32)
_ALIGN = DIRECT_ALIGN // 4  # fp32 elements per 4 KiB: entries sit at aligned offsets so reads go O_DIRECT


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class NvmeOptimizerSwapper:
    kind = "nvme"

    def __init__(
        self,
        masters: list[torch.nn.Parameter],
        sub_groups: list[list[int]],
        *,
        directory,
        rank: int,
        aio: AsyncIO,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        pin: bool = False,
    ):
        self.masters = masters
        self.numels = [m.numel() for m in masters]
        self.sub_groups = sub_groups
        self.directory = directory
        self.rank = rank
        self.aio = aio
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.pin = pin
        self.sets = 1 + int(pipeline_read) + int(pipeline_write)
        self.largest = max((sum(_padded(self.numels[i]) for i in sub) for sub in sub_groups), default=0)
        self.swaps: dict[str, SwapFile] = {}
        self.pools: dict[str, BufferPool] = {}
        self.state_keys: list[str] = []
        self._add_kind(MASTER)
        requests = [self.swaps[MASTER].write(i, m.detach().reshape(-1)) for i, m in enumerate(masters)]
        for r in requests:
            r.wait()
        for m in masters:
            m.data = _EMPTY

    def _add_kind(self, kind: str) -> None:
        swap = SwapFile(self.directory, f"rank{self.rank}_optim_{kind}", self.aio)
        for i, n in enumerate(self.numels):
            swap.reserve(i, n, torch.float32)
        swap.allocate()
        self.swaps[kind] = swap
        self.pools[kind] = BufferPool(
            self.sets,
            max(self.largest, 1),
            torch.float32,
            pin=self.pin,
            size_key="zero_optimization.sub_group_size",
            count_key="zero_optimization.offload_optimizer.buffer_count",
        )
        if kind != MASTER:
            self.state_keys.append(kind)

    # -- one sub-group's resident window -----------------------------------------------------------
    def _read(self, sub: list[int], kinds: list[str]) -> tuple[dict, list]:
        total = sum(_padded(self.numels[i]) for i in sub)
        bufs, reqs = {}, []
        for kind in kinds:
            buf = self.pools[kind].acquire(total)
            bufs[kind] = buf
            if self.swaps[kind].run_nbytes(sub) == total * 4:  # Note [one request per sub-group]
                reqs.append(self.swaps[kind].read_run(sub, buf))
                continue
            off = 0
            for i in sub:
                reqs.append(self.swaps[kind].read(i, buf[off : off + self.numels[i]]))
                off += _padded(self.numels[i])
        return bufs, reqs

    def _attach(self, optimizer, sub: list[int], bufs: dict) -> None:
        off = 0
        for i in sub:
            n, m = self.numels[i], self.masters[i]
            m.data = bufs[MASTER][off : off + n]
            state = optimizer.state.get(m) if optimizer is not None else None
            for key in self.state_keys:
                if state is not None and key in state:
                    state[key] = bufs[key][off : off + n]
            off += _padded(n)

    def _detach(self, optimizer, sub: list[int]) -> None:
        for i in sub:
            m = self.masters[i]
            m.data = _EMPTY
            state = optimizer.state.get(m) if optimizer is not None else None
            for key in self.state_keys:
                if state is not None and key in state:
                    state[key] = _EMPTY

    def _discover_states(self, optimizer, sub: list[int]) -> None:
        """After a first step: swap files for the elementwise state the optimizer created."""
        m = self.masters[sub[0]]
        for key, v in optimizer.state.get(m, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == m.numel() and v.dim() > 0 and key not in self.swaps:
                self._add_kind(key)

    def _write_buffers(self, optimizer, sub: list[int], bufs: dict) -> list | None:
        """Note [one request per sub-group]: a sub-group's slots are consecutive in each swap file and
        its host buffer has the same 4 KiB-aligned layout, so each kind is one large request — when
        every master and state still is a view of its buffer (the optimizer updated them in place)."""
        total = sum(_padded(self.numels[i]) for i in sub)
        kinds = [MASTER] + [k for k in self.state_keys if k in bufs]
        if set(bufs) != set(kinds) or any(self.swaps[k].run_nbytes(sub) != total * 4 for k in kinds):
            return None
        off = 0
        for i in sub:
            m = self.masters[i]
            state = optimizer.state.get(m, {}) if optimizer is not None else {}
            views = [(m, MASTER)] + [(state.get(k), k) for k in kinds[1:]]
            if any(t is None or t.data_ptr() != bufs[k][off:].data_ptr() for t, k in views):
                return None
            off += _padded(self.numels[i])
        return [self.swaps[k].write_run(sub, bufs[k][:total]) for k in kinds]

    def _write(self, optimizer, sub: list[int]) -> list:
        reqs = []
        for i in sub:
            m = self.masters[i]
            reqs.append(self.swaps[MASTER].write(i, m.detach().reshape(-1)))
            state = optimizer.state.get(m, {}) if optimizer is not None else {}
            for key in self.state_keys:
                if key in state and state[key].numel() == self.numels[i]:
                    reqs.append(self.swaps[key].write(i, state[key].reshape(-1)))
        return reqs

    def _release(self, bufs: dict) -> None:
        for kind, buf in bufs.items():
            self.pools[kind].release(buf)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer, grads, coef: float, sub_groups, on_stepped: OnStepped | None = None) -> None:
        """Step each sub-group with its masters and states read in, publishing and writing it back."""
        scale_grads(grads, coef)
        subs = [list(s) for s in sub_groups]
        pending_writes: list[tuple[list, dict]] = []
        nxt = None
        for k, sub in enumerate(subs):
            first = not self._has_state(optimizer, sub)
            bufs, reqs = nxt if nxt is not None else self._read(sub, self._kinds(optimizer, sub))
            nxt = None
            for r in reqs:
                r.wait()
            if self.pipeline_read and k + 1 < len(subs):
                nxt = self._read(subs[k + 1], self._kinds(optimizer, subs[k + 1]))
            self._attach(optimizer, sub, bufs)
            step_one(optimizer, [grads[i] for i in sub])
            if first:
                self._discover_states(optimizer, sub)
            if on_stepped is not None:
                on_stepped(sub)
            writes = None if first else self._write_buffers(optimizer, sub, bufs)
            writes = writes if writes is not None else self._write(optimizer, sub)
            if first:  # the optimizer allocated these states itself: wait before dropping them
                for r in writes:
                    r.wait()
                writes = []
            self._detach(optimizer, sub)
            pending_writes.append((writes, bufs))
            while len(pending_writes) > (1 if self.pipeline_write else 0):
                self._finish_write(*pending_writes.pop(0))
        for w in pending_writes:
            self._finish_write(*w)

    def _finish_write(self, reqs: list, bufs: dict) -> None:
        for r in reqs:
            r.wait()
        self._release(bufs)

    def _has_state(self, optimizer, sub: list[int]) -> bool:
        state = optimizer.state.get(self.masters[sub[0]]) if optimizer is not None else None
        return bool(state)

    def _kinds(self, optimizer, sub: list[int]) -> list[str]:
        return [MASTER] + (self.state_keys if self._has_state(optimizer, sub) else [])

    @contextlib.contextmanager
    def resident(self, optimizer) -> Iterator[None]:
        """Everything read into fresh memory for the duration (checkpoint save/load), then written
        back: a checkpoint needs the whole shard at once."""
        for i, m in enumerate(self.masters):
            t = torch.empty(self.numels[i], dtype=torch.float32)
            self.swaps[MASTER].read(i, t).wait()
            m.data = t
            state = optimizer.state.get(m, {}) if optimizer is not None else {}
            for key in self.state_keys:
                if key in state:
                    s = torch.empty(self.numels[i], dtype=torch.float32)
                    self.swaps[key].read(i, s).wait()
                    state[key] = s
        try:
            yield
        finally:
            if optimizer is not None:
                for m in self.masters:  # a checkpoint load may have created state for new keys
                    for key, v in optimizer.state.get(m, {}).items():
                        if (
                            isinstance(v, torch.Tensor)
                            and v.dim() > 0
                            and v.numel() == m.numel()
                            and key not in self.swaps
                        ):
                            self._add_kind(key)
            reqs = self._write(optimizer, list(range(len(self.masters))))
            for r in reqs:
                r.wait()
            self._detach(optimizer, list(range(len(self.masters))))

    # -- introspection -----------------------------------------------------------------------------
    def files(self) -> list[tuple[str, object, int]]:
        """(kind, path, bytes) of every swap file."""
        return [(kind, s.path, s.nbytes) for kind, s in self.swaps.items()]

    def buffer_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())

    def state_bytes_in_memory(self, optimizer) -> int:
        return 0

    def close(self) -> None:
        for s in self.swaps.values():
            s.close()
