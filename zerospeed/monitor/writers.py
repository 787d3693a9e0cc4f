"""Monitors: each takes `write_events([(tag, value, step), ...])` and writes them somewhere.

CSV needs nothing installed. TensorBoard writes through `torch.utils.tensorboard.SummaryWriter`
(the `tensorboard` extra); WandB and Comet import their packages only when enabled. A missing
package is a ConfigError naming what to install.
"""

from __future__ import annotations

import csv
from pathlib import Path

from zerospeed.utils.errors import ConfigError

Event = tuple[str, float, int]


def _run_dir(output_path: str, job_name: str) -> Path:
    # DeepSpeed leaves the default location to the monitor; ours is ./runs/<job_name>.
    return Path(output_path or "runs") / job_name


class TensorBoardMonitor:
    """Writes `events.out.tfevents.*` under output_path/job_name through TensorBoard's SummaryWriter."""

    def __init__(self, output_path: str, job_name: str):
        tb = _require("torch.utils.tensorboard", "tensorboard", package="tensorboard", pip="'zerospeed[tensorboard]'")
        self.dir = _run_dir(output_path, job_name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = tb.SummaryWriter(log_dir=str(self.dir))

    def write_events(self, events: list[Event], flush: bool = True) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, float(value), int(step))
        if flush:  # as DeepSpeed does: one flush per optimizer step, so a crash loses at most that step
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_scalars(path: str | Path) -> list[Event]:
    """Every (tag, value, step) scalar in an event file or a run directory, read back by TensorBoard's
    own `EventAccumulator`; grouped by tag (sorted), each tag's events in the order written."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError:
        raise ImportError(
            "reading TensorBoard event files needs tensorboard: pip install 'zerospeed[tensorboard]'"
        ) from None
    if not Path(path).exists():
        raise FileNotFoundError(f"no TensorBoard event file or run directory at {path}")
    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})  # 0: keep every event, no sampling
    acc.Reload()
    return [(tag, e.value, e.step) for tag in sorted(acc.Tags()["scalars"]) for e in acc.Scalars(tag)]


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


def _require(module: str, section: str, package: str | None = None, pip: str | None = None):
    """Import `module` for the `section` monitor, or raise a ConfigError naming what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module
        pip = pip or package.replace("_", "-")
        raise ConfigError(
            f"{section}.enabled=true but the `{package}` package is not installed; "
            f"`pip install {pip}` or set {section}.enabled to false"
        ) from None


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
        self.experiment = comet_ml.start(
            api_key=cfg.api_key,
            project=cfg.project,
            workspace=cfg.workspace,
            experiment_key=cfg.experiment_key,
            mode=cfg.mode,
            online=cfg.online,
        )
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
