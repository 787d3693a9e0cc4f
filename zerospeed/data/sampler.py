"""Curriculum data sampling (DeepSpeed's `data_efficiency.data_sampling.curriculum_learning`): the batches a
model trains on are drawn only from the samples whose analyzed difficulty (data/analyzer.py) the
schedule already allows.

Note [curriculum clusters]: each metric has a `CurriculumScheduler` (data/curriculum.py) whose difficulty
grows with the curriculum step (one step per global batch, the first batch is step 1). Whenever a
difficulty changes, the samples that the new difficulties admit and no earlier cluster holds become a
new *cluster*, shuffled once:

* `difficulty_type: "value"`: a metric admits the samples whose value lies in (previous, current]
  (`index_to_metric_path` gives the values, `index_to_sample_path` the samples of each value);
* `"percentile"`: the difficulty is a percentile of the samples sorted by value: with `n` samples and
  `max_difficulty` = P, (previous, current] admits sorted positions [n // P * previous, n // P * current)
  (up to n at P);
* `clustering_type: "single_cluster"`: the metric admits everything; with two or more clustered metrics
  a cluster is the intersection of what each admits up to its current difficulty, minus older clusters.

A global batch (micro batch x data-parallel ranks x accumulation steps) draws from the clusters in
proportion to their sizes (a multinomial draw), reads each cluster's next samples in its shuffled order
(a cluster read to its end is reshuffled and read again), and is shuffled; each micro-step hands rank r
its share `[round(r L / dp), round((r + 1) L / dp))` of the next L = micro x dp samples. Everything random
comes from one `numpy.random.default_rng(data_efficiency.seed)` in DeepSpeed's order of calls (cluster
shuffles, the multinomial draw, reshuffles, the batch shuffle), so the order is DeepSpeed's. The leader
(the data-parallel group's first rank) draws and broadcasts; global rank 0 also writes each cluster to
`data_cluster_path` as an indexed file named `cluster_<metric><difficulty>...`, as DeepSpeed does.

Difference on purpose: DeepSpeed's `state_dict` saves numpy's *global* RNG state, not the sampler's
generator, so its resumed order differs from the uninterrupted one; here the generator's state is saved
and a resumed run continues exactly (a DeepSpeed checkpoint's global state still loads, as there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.data.curriculum import CurriculumScheduler
from zerospeed.data.indexed import IndexedFile, fit_int_dtype, write_indexed
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]

VALUE, PERCENTILE, SINGLE = "value", "percentile", "single_cluster"
_KEYS = ("min_difficulty", "max_difficulty", "schedule_type", "difficulty_type", "clustering_type")


class _Metric:
    """One curriculum metric: its schedule and (on the leader) its analyzed index files."""

    def __init__(self, name: str, cfg: dict, leader: bool):
        missing = [k for k in _KEYS if cfg.get(k) is None]
        if missing:
            raise ConfigError(f"data_sampling.curriculum_learning.curriculum_metrics.{name}: set {', '.join(missing)}")
        self.name, self.cfg = name, cfg
        self.scheduler = CurriculumScheduler(cfg)
        self.kind, self.clustering = cfg["difficulty_type"], cfg["clustering_type"]
        if self.kind not in (VALUE, PERCENTILE):
            raise ConfigError(
                f"curriculum_metrics.{name}.difficulty_type={self.kind!r}: expected 'value' or 'percentile'"
            )
        self.index_to_sample = self.index_to_metric = None
        if leader and self.clustering != SINGLE:
            self.index_to_sample = IndexedFile(self._path("index_to_sample_path"))
            if self.kind == VALUE:
                self.index_to_metric = IndexedFile(self._path("index_to_metric_path"))

    def _path(self, key: str) -> str:
        path = self.cfg.get(key)
        if path is None or not IndexedFile.exists(path):
            raise ConfigError(
                f"data_sampling.curriculum_learning.curriculum_metrics.{self.name}.{key}={path!r}: no indexed "
                "file there (path.bin + path.idx); run the data analyzer (zerospeed.data.analyzer) first"
            )
        return path

    def start(self) -> float:
        return -math.inf if self.kind == VALUE else 0

    def between(self, low, high) -> np.ndarray | None:
        """The samples this metric admits in (low, high]: Note [curriculum clusters]."""
        rows = self.index_to_sample
        if self.kind == VALUE:
            picked = [rows[i] for i in range(len(rows)) if low < self.index_to_metric[i][0] <= high]
            return np.concatenate(picked) if picked else None
        total = int(sum(len(r) for r in rows[:]))
        top = self.cfg["max_difficulty"]
        per = total // top
        end = total if high == top else per * high
        return np.concatenate(rows[:])[per * low : end] if len(rows) else None


class DeepSpeedDataSampler:
    """The curriculum batch sampler: yields this rank's sample indices, one micro-batch at a time
    (DeepSpeed's `DeepSpeedDataSampler`, same arguments); Note [curriculum clusters]."""

    def __init__(
        self,
        data_efficiency_config: dict,
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group,
        gradient_accumulation_steps: int,
        global_rank: int,
        drop_last: bool = True,
    ):
        sampling = data_efficiency_config["data_sampling"]
        curriculum = sampling["curriculum_learning"]
        if not curriculum.get("curriculum_metrics"):
            raise ConfigError("data_sampling.curriculum_learning.curriculum_metrics must name at least one metric")
        if curriculum.get("data_cluster_path") is None:
            raise ConfigError("data_sampling.curriculum_learning.data_cluster_path is required (the clusters go there)")
        if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
            raise ValueError(
                f"DeepSpeedDataSampler: data-parallel rank {data_parallel_rank} of {data_parallel_size}, "
                f"micro batch {micro_batch_size}"
            )
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * sampling["num_epochs"]
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.data_parallel_size, self.data_parallel_group = data_parallel_size, data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank, self.drop_last = global_rank, drop_last
        self.cluster_dir = curriculum["data_cluster_path"]
        self.leader = comm.get_rank(data_parallel_group) == 0
        self.writer = global_rank == 0
        self.index_dtype = fit_int_dtype(0, one_epoch_total_samples)
        self.np_rng = np.random.default_rng(data_efficiency_config.get("seed", 1234))
        self.metrics = {n: _Metric(n, dict(c), self.leader) for n, c in curriculum["curriculum_metrics"].items()}
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.data_clusters: list[np.ndarray] = []  # the leader's clusters, in their current shuffled order
        if self.writer:
            os.makedirs(self.cluster_dir, exist_ok=True)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable]) -> None:
        for name, fn in schedule_func_dict.items():
            if name in self.metrics:
                self.metrics[name].scheduler.set_custom_get_difficulty(fn)

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice of a micro-step's `batch_len` samples."""
        n = batch_len or self.micro_batch_times_data_parallel_size
        return round(self.data_parallel_rank * n / self.data_parallel_size), round(
            (self.data_parallel_rank + 1) * n / self.data_parallel_size
        )

    # -- clusters (leader) ------------------------------------------------------------------------------
    def _new_cluster(self, previous: dict) -> np.ndarray | None:
        clustered = [m for m in self.metrics.values() if m.clustering != SINGLE]
        everything = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
        if len(clustered) > 1:
            cluster = None
            for m in self.metrics.values():
                part = everything if m.clustering == SINGLE else m.between(m.start(), self.current_difficulties[m.name])
                part = np.zeros(0, dtype=self.index_dtype) if part is None else part
                cluster = part if cluster is None else np.intersect1d(cluster, part, assume_unique=True)
            for old in self.data_clusters:
                cluster = np.setdiff1d(cluster, old, assume_unique=True)
            return cluster
        cluster = everything if not self.data_clusters else None
        for m in clustered:
            cluster = m.between(previous[m.name], self.current_difficulties[m.name])
        return cluster

    def _cluster_name(self) -> str:
        return "cluster" + "".join(f"_{n}{self.current_difficulties[n]}" for n in self.metrics)

    def _write(self, name: str, cluster: np.ndarray) -> None:
        if self.writer:
            write_indexed(os.path.join(self.cluster_dir, name), [cluster], self.index_dtype)

    def _add_cluster(self, previous: dict) -> None:
        name = self._cluster_name()
        cluster = self._new_cluster(previous) if self.leader else None
        if self.leader and cluster is not None and len(cluster):
            self.np_rng.shuffle(cluster)
            self.data_clusters.append(cluster)
            self._write(name, cluster)
            logger.info(
                "curriculum sampler: new cluster %s of %d samples (step %d)", name, len(cluster), self.curriculum_step
            )
        made = bool(self.leader and cluster is not None and len(cluster))
        made = comm.broadcast_object(made, src=self._leader_rank(), group=self.data_parallel_group)
        if made:
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def _leader_rank(self) -> int:
        return comm.global_rank(self.data_parallel_group, 0) if comm.is_initialized() else 0

    def _take(self, c: int, count: int) -> list:
        start = self.data_cluster_current_position[c]
        out = list(self.data_clusters[c][start : start + count])
        self.data_cluster_current_position[c] += count
        if len(out) < count:  # read to its end: reshuffled, then read again from the start
            rest = count - len(out)
            cluster = np.copy(self.data_clusters[c])
            self.np_rng.shuffle(cluster)
            self.data_clusters[c] = cluster
            self._write(self.data_cluster_paths[c], cluster)
            out += list(cluster[:rest])
            self.data_cluster_current_position[c] = rest
        return out

    def _draw(self) -> list:
        sizes = [len(c) for c in self.data_clusters]
        total = sum(sizes)
        picks = self.np_rng.choice(len(sizes), self.global_batch_size, replace=True, p=[s / total for s in sizes])
        counts = np.bincount(picks, minlength=len(sizes))
        batch = []
        for c in range(len(counts)):
            batch += self._take(c, int(counts[c]))
        self.np_rng.shuffle(batch)
        return batch

    # -- batches ------------------------------------------------------------------------------------------
    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and draw the next global batch (collective over the group)."""
        self.curriculum_step += 1
        previous, changed = {}, False
        for name, m in self.metrics.items():
            nxt = m.scheduler.update_difficulty(self.curriculum_step)
            changed |= self.current_difficulties.get(name) != nxt
            previous[name] = self.current_difficulties.get(name, m.start())
            self.current_difficulties[name] = nxt
        if changed:
            self._add_cluster(previous)
        batch = torch.full((self.global_batch_size,), -1, dtype=torch.long)
        if self.leader:
            drawn = self._draw()
            batch[: len(drawn)] = torch.tensor([int(i) for i in drawn], dtype=torch.long)
        batch = batch.to(get_accelerator().torch_device(comm.get_local_rank()))  # (NCCL broadcasts device tensors)
        comm.broadcast(batch, src=self._leader_rank(), group=self.data_parallel_group)
        self.batch = batch[batch != -1].cpu().tolist()

    def __iter__(self):
        step = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current, self.batch = self.batch[:step], self.batch[step:]
            if len(current) == step or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                yield current[start:end]
                self.consumed_samples += len(current)

    # -- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """DeepSpeed's keys; `np_rng_state` is this sampler's generator (see the module docstring)."""
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "data_cluster_paths": list(self.data_cluster_paths),
            "data_cluster_current_position": [int(p) for p in self.data_cluster_current_position],
            "np_rng_state": self.np_rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.batch = list(state["batch"])
        self.consumed_samples = state["consumed_samples"]
        self.curriculum_step = state["curriculum_step"]
        self.current_difficulties = dict(state["current_difficulties"])
        self.data_cluster_paths = [os.path.basename(p) for p in state["data_cluster_paths"]]
        self.data_cluster_current_position = list(state["data_cluster_current_position"])
        rng = state["np_rng_state"]
        if isinstance(rng, dict):
            self.np_rng.bit_generator.state = rng
        else:  # a DeepSpeed checkpoint: numpy's global state, restored as DeepSpeed restores it
            np.random.set_state(rng)
        if self.leader:
            self.data_clusters = [
                np.array(IndexedFile(os.path.join(self.cluster_dir, p))[0]) for p in self.data_cluster_paths
            ]


class CurriculumDataLoader:
    """The training loader under curriculum sampling (DeepSpeed's `DeepSpeedDataLoader` with its data
    sampler): micro-batches of the sampler's indices; `post_process_func(batch, sampler_state)` as
    DeepSpeed's; `state_dict` is the sampler's (what checkpoints save as `data_sampler`)."""

    def __init__(
        self,
        dataset,
        sampler: DeepSpeedDataSampler,
        *,
        collate_fn=None,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ):
        self.dataset, self.data_sampler = dataset, sampler
        self.batch_size = sampler.micro_batch_size
        self.post_process_func: Callable | None = None
        self.loader = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory
        )
        n = len(sampler)
        self.len = n // self.batch_size if drop_last else -(-n // self.batch_size)
        self._it = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        self._it = iter(self.loader)
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        data = next(self._it)
        if self.post_process_func is not None:
            data = self.post_process_func(data, self.data_sampler.state_dict())
        return data

    def state_dict(self) -> dict:
        return self.data_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data_sampler.load_state_dict(state)
        self._it = None


def build_curriculum_loader(
    dataset,
    data_efficiency: dict,
    micro_batch: int,
    *,
    dp_rank: int,
    dp_world: int,
    dp_group,
    gradient_accumulation_steps: int,
    global_rank: int,
    collate_fn=None,
    drop_last: bool = False,
) -> CurriculumDataLoader:
    """The training loader `initialize(training_data=...)` builds when curriculum sampling is on."""
    sampler = DeepSpeedDataSampler(
        data_efficiency,
        len(dataset),
        micro_batch,
        dp_rank,
        dp_world,
        dp_group,
        gradient_accumulation_steps,
        global_rank,
        drop_last=drop_last,
    )
    sampling = data_efficiency["data_sampling"]
    return CurriculumDataLoader(
        dataset,
        sampler,
        collate_fn=collate_fn,
        num_workers=sampling.get("num_workers", 0),
        pin_memory=bool(sampling.get("pin_memory", False)) and torch.cuda.is_available(),
        drop_last=drop_last,
    )
