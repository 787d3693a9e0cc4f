"""Monitors: each takes `write_events([(tag, value, step), ...])` and writes them somewhere.

TensorBoard and CSV need nothing installed; WandB and Comet import their packages only when
enabled and fail with a clear error when they are missing.
"""
from __future__ import annotations

import csv
import os
import socket
import time
from pathlib import Path

from zerospeed.config.errors import ConfigError
from zerospeed.monitor.tfevents import encode_scalar_event, encode_version_event, record

Event = tuple[str, float, int]


def _run_dir(output_path: str, job_name: str) -> Path:
    # DeepSpeed leaves the default location to the monitor; ours is ./runs/<job_name>.
    return Path(output_path or "runs") / job_name


class TensorBoardMonitor:
    """Writes `events.out.tfevents.<time>.<host>` under output_path/job_name."""

    def __init__(self, output_path: str, job_name: str):
        self.dir = _run_dir(output_path, job_name)
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")
        self._f.write(record(encode_version_event(now)))
        self._f.flush()

    def write_events(self, events: list[Event]) -> None:
        now = time.time()
        for tag, value, step in events:
            self._f.write(record(encode_scalar_event(tag, float(value), int(step), now)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class CsvMonitor:
    """One CSV per tag (slashes become underscores), header `step,<tag>`, under output_path/job_name."""

    def __init__(self, output_path: str, job_name: str):
        self.dir = _run_dir(output_path, job_name)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, tag: str) -> Path:
        return self.dir / (tag.replace("/", "_") + ".csv")

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            path = self.path_for(tag)
            new = not path.exists()
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", tag])
                w.writerow([int(step), float(value)])

    def close(self) -> None:
        pass


def _require(module: str, section: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{section}.enabled=true but the `{module}` package is not installed; "
                          f"`pip install {module.replace('_', '-')}` or set {section}.enabled to false") from None


class WandbMonitor:
    """Logs to Weights & Biases (project, group, team from the `wandb` block)."""

    def __init__(self, cfg):
        self.wandb = _require("wandb", "wandb")
        self.wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


class CometMonitor:
    """Logs to Comet (the `comet` block's project, workspace, experiment, online/offline)."""

    def __init__(self, cfg):
        comet_ml = _require("comet_ml", "comet")
        self.experiment = comet_ml.start(api_key=cfg.api_key, project=cfg.project, workspace=cfg.workspace,
                                         experiment_key=cfg.experiment_key, mode=cfg.mode, online=cfg.online)
        if cfg.experiment_name:
            self.experiment.set_name(cfg.experiment_name)
        self.interval = cfg.samples_log_interval
        self._last: dict[str, int] = {}

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            # samples_log_interval: submit a tag at most once per that many samples.
            if step - self._last.get(tag, -self.interval) >= self.interval:
                self.experiment.log_metric(tag, value, step=step)
                self._last[tag] = step

    def close(self) -> None:
        self.experiment.end()


def build_monitors(config) -> list:
    """The monitors a `ZeroSpeedConfig` enables (call on the rank that writes, i.e. rank 0)."""
    monitors: list = []
    if config.tensorboard.enabled:
        monitors.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.csv_monitor.enabled:
        monitors.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.wandb.enabled:
        monitors.append(WandbMonitor(config.wandb))
    if config.comet.enabled:
        monitors.append(CometMonitor(config.comet))
    return monitors
