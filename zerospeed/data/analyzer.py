"""The offline data analyzer of DeepSpeed's data-efficiency library (`DataAnalyzer`): one pass over a
dataset computing per-sample difficulty metrics, written as the indexed files the curriculum sampler
(data/sampler.py) reads. The constructor and `run_map` / `run_reduce` / `run_map_reduce` are DeepSpeed's.

For a metric `m` of type `single_value_per_sample` (`metric_function(batch)` returns one integer per
sample) the results land in `save_path/m/` (indexed files, data/indexed.py; the dtypes are the smallest
integer types that fit, as DeepSpeed picks them):

* `m_sample_to_metric`: one item per sample, in dataset order: `[value]`.
* `m_index_to_metric`: one item per distinct value, ascending: `[value]`.
* `m_index_to_sample`: one item per distinct value, aligned with `m_index_to_metric`: the indices of
  the samples with that value, in dataset order.
* `m_index_to_sample_percentile_merged`: the rows of `m_index_to_sample` concatenated in groups of
  `max(1, distinct values // 100)` consecutive values (the file percentile-based curricula read).

For `accumulate_value_over_samples` (`metric_function(batch)` returns a tensor summed over batches)
`m_metric_value` holds the one summed item.

The map runs over worker `worker_id`'s contiguous share of the dataset (of `num_workers`), in one
thread (`num_threads` > 1 splits the share the same way but still runs it in this process); each worker
writes its partial results under `save_path/m/worker{w}_thread{t}/`, and the reduce (on worker 0 after
every worker's map) merges them in worker order.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from zerospeed import comm
from zerospeed.data.indexed import IndexedFile, IndexedWriter, fit_int_dtype, write_indexed
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

SINGLE = "single_value_per_sample"
ACCUMULATE = "accumulate_value_over_samples"


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) cut into `parts` contiguous ranges, as DeepSpeed's analyzer cuts it (np.linspace)."""
    bounds = np.linspace(start, end, dtype=int, num=parts + 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        return torch.empty(0, dtype=dtype).numpy().dtype
    return np.dtype(dtype)


class DataAnalyzer:
    """DeepSpeed's `DataAnalyzer` (deepspeed.runtime.data_pipeline.data_sampling.data_analyzer); see the
    module docstring for the files. `custom_map_*` / `custom_reduce` replace the built-in map / reduce."""

    def __init__(
        self,
        dataset,
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] = (),
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[Callable] = (),
        metric_types: Sequence[str] = (),
        metric_dtypes: Sequence = (),
        save_path: str = "./",
        collate_fn: Callable | None = None,
        custom_map_init: Callable | None = None,
        custom_map_update: Callable | None = None,
        custom_map_finalize: Callable | None = None,
        custom_reduce: Callable | None = None,
        sample_indices: Sequence[int] | None = None,
    ):
        if not len(metric_names) == len(metric_functions) == len(metric_types) == len(metric_dtypes):
            raise ValueError(
                "DataAnalyzer: metric_names, metric_functions, metric_types, metric_dtypes differ in length"
            )
        for name, kind in zip(metric_names, metric_types):
            if kind not in (SINGLE, ACCUMULATE):
                raise ValueError(
                    f"DataAnalyzer: metric {name!r} has type {kind!r}; expected {SINGLE!r} or {ACCUMULATE!r}"
                )
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), [_np_dtype(d) for d in metric_dtypes]
        self.save_path = save_path
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices

    # -- map ------------------------------------------------------------------------------------------
    def _dir(self, name: str, worker: int, thread: int) -> str:
        return os.path.join(self.save_path, name, f"worker{worker}_thread{thread}")

    def run_map(self) -> None:
        """This worker's share: each thread range's metric values, written under its worker/thread folder."""
        share = split_index(0, len(self.dataset), self.num_workers)[self.worker_id]
        threads = self.specific_threads or range(self.num_threads)
        for t in threads:
            start, end = split_index(share[0], share[1], self.num_threads)[t]
            self._map_range(t, start, end)

    def _map_range(self, thread: int, start: int, end: int) -> None:
        loader = DataLoader(
            Subset(self.dataset, range(start, end)), batch_size=self.batch_size, collate_fn=self.collate_fn
        )
        if self.custom_map_init is not None:
            results = self.custom_map_init(
                thread, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path, self.worker_id
            )
        else:
            results = [{"values": [], "samples": [], "sum": None} for _ in self.metric_names]
        position = start
        for batch in loader:
            if self.custom_map_update is not None:
                self.custom_map_update(batch, self.metric_types, self.metric_dtypes, self.metric_functions, results)
            else:
                position = self._update(batch, results, position)
        if self.custom_map_finalize is not None:
            self.custom_map_finalize(self.metric_types, self.metric_dtypes, results)
            return
        for name, kind, dtype, res in zip(self.metric_names, self.metric_types, self.metric_dtypes, results):
            folder = self._dir(name, self.worker_id, thread)
            if kind == SINGLE:
                write_indexed(os.path.join(folder, f"{name}_sample_to_metric"), [[v] for v in res["values"]], dtype)
                write_indexed(os.path.join(folder, f"{name}_sample_index"), [res["samples"]], np.int64)
            elif res["sum"] is not None:
                write_indexed(os.path.join(folder, f"{name}_metric_value"), [res["sum"]], np.int64)

    def _update(self, batch, results: list[dict], position: int) -> int:
        rows = 0
        for name, kind, dtype, fn, res in zip(
            self.metric_names, self.metric_types, self.metric_dtypes, self.metric_functions, results
        ):
            values = fn(batch)
            if not isinstance(values, (torch.Tensor, np.ndarray)):
                raise TypeError(f"DataAnalyzer: metric_function of {name!r} must return a tensor or array")
            values = values.cpu().numpy() if isinstance(values, torch.Tensor) else values
            if values.dtype != dtype:
                raise TypeError(f"DataAnalyzer: metric {name!r} returned {values.dtype}, metric_dtype is {dtype}")
            if kind == ACCUMULATE:
                res["sum"] = values.astype(np.int64) if res["sum"] is None else res["sum"] + values
                continue
            rows = len(values)
            for row in range(rows):
                res["values"].append(int(values[row].reshape(-1)[0]))
                res["samples"].append(self._sample_index(batch, position + row, row))
        return position + rows

    def _sample_index(self, batch, position: int, row: int) -> int:
        if isinstance(batch, dict) and "index" in batch:  # Megatron's datasets carry their sample index
            return int(batch["index"][row][0])
        return int(self.sample_indices[position]) if self.sample_indices is not None else position

    # -- reduce ---------------------------------------------------------------------------------------
    def run_reduce(self) -> None:
        """Merge every worker's map results into the files of the module docstring."""
        if self.custom_reduce is not None:
            self.custom_reduce(
                self.dataset,
                self.metric_names,
                self.metric_types,
                self.save_path,
                self.num_workers,
                self.num_threads,
                self.num_threads_reduce,
            )
            return
        parts = [(w, t) for w in range(self.num_workers) for t in range(self.num_threads)]
        for name, kind in zip(self.metric_names, self.metric_types):
            if kind == SINGLE:
                self._reduce_single(name, parts)
            else:
                self._reduce_accumulated(name, parts)

    def _reduce_single(self, name: str, parts: list[tuple[int, int]]) -> None:
        values, samples = [], []
        for w, t in parts:
            folder = self._dir(name, w, t)
            values.append(np.array([int(x[0]) for x in IndexedFile(os.path.join(folder, f"{name}_sample_to_metric"))]))
            samples.append(IndexedFile(os.path.join(folder, f"{name}_sample_index"))[0].astype(np.int64))
        values_N, samples_N = np.concatenate(values).astype(np.int64), np.concatenate(samples)
        total = len(self.dataset)
        if len(values_N) != total:
            raise RuntimeError(f"DataAnalyzer: {len(values_N)} samples mapped for {name!r}, the dataset has {total}")
        folder = os.path.join(self.save_path, name)
        value_dtype, sample_dtype = fit_int_dtype(int(values_N.min()), int(values_N.max())), fit_int_dtype(0, total - 1)
        # DeepSpeed merges num_threads_reduce chunks, each ending a document (the format: data/indexed.py)
        part_ends = np.cumsum([len(v) for v in values])[
            [e - 1 for _, e in split_index(0, len(parts), self.num_threads_reduce)]
        ]
        with IndexedWriter(os.path.join(folder, f"{name}_sample_to_metric"), value_dtype) as w:
            for i, v in enumerate(values_N):
                w.add([v])
                if i + 1 in part_ends:
                    w.end_document()
        distinct = np.unique(values_N).tolist()
        by_value = defaultdict(list)
        for v, s in zip(values_N.tolist(), samples_N.tolist()):
            by_value[v].append(s)
        rows = [np.array(by_value[v], dtype=np.int64) for v in distinct]
        value_ends = {e for _, e in split_index(0, len(rows), self.num_threads_reduce)}
        with (
            IndexedWriter(os.path.join(folder, f"{name}_index_to_metric"), value_dtype) as im,
            IndexedWriter(os.path.join(folder, f"{name}_index_to_sample"), sample_dtype) as is_,
        ):
            for k, (v, row) in enumerate(zip(distinct, rows)):
                im.add([v])
                is_.add(row)
                if k + 1 in value_ends:
                    im.end_document()
                    is_.end_document()
        step = max(1, len(rows) // 100)
        with IndexedWriter(os.path.join(folder, f"{name}_index_to_sample_percentile_merged"), sample_dtype) as w:
            for v in range(0, len(rows), step):
                w.add(np.concatenate(rows[v : v + step]))
        logger.info(
            "data analyzer: metric %s: %d distinct values in [%d, %d]", name, len(rows), distinct[0], distinct[-1]
        )

    def _reduce_accumulated(self, name: str, parts: list[tuple[int, int]]) -> None:
        total = None
        for w, t in parts:
            prefix = os.path.join(self._dir(name, w, t), f"{name}_metric_value")
            if IndexedFile.exists(prefix):
                value = IndexedFile(prefix)[0].astype(np.int64)
                total = value if total is None else total + value
        if total is None:
            raise RuntimeError(f"DataAnalyzer: no map results for {name!r}")
        dtype = fit_int_dtype(int(total.min()), int(total.max()))
        write_indexed(os.path.join(self.save_path, name, f"{name}_metric_value"), [total], dtype)

    def run_map_reduce(self, comm_group=None) -> None:
        """Map this worker's share, wait for every worker, reduce on worker 0, wait again."""
        self.run_map()
        comm.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        comm.barrier(group=comm_group)
