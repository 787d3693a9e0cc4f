"""`Autotuner`: plan the space, run the trials, write the results (DeepSpeed's class, zerospeed's way).

    tuner = Autotuner(["--num_gpus", "2"], UserCommand("train.py", ("--deepspeed", "ds_config.json")))
    outcome = tuner.tune()          # results_dir/ds_config_optimal.json, results.md, summary.txt
    tuner.run_after_tuning()        # train with the best config

`tune` reads the script's config, splits its tuning lists off (`space`), learns the model's size from
``autotuning.model_info`` or a model-information run (profiling/trial_probe.py), lets the planner
prune what cannot fit (`planner`), and then lets the search (`tuner`) pick trials, each a short profiled
run of the script through the launcher in a process group of its own with a time limit (`trial`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerospeed.accelerator import get_accelerator
from zerospeed.autotuning import command as cmdline
from zerospeed.autotuning.command import TrialWorld
from zerospeed.autotuning.planner import DOMINATED, MEMORY_HEADROOM, OK, ModelInfo, Planned, min_memory, plan
from zerospeed.autotuning.results import NOT_RUN, UNITS, Record, best_record, write_optimal, write_results
from zerospeed.autotuning.space import Candidate, split_space, trial_config
from zerospeed.autotuning.trial import CRASHED, TrialResult, run_trial, trial_timeout
from zerospeed.autotuning.trial import OK as TRIAL_OK
from zerospeed.autotuning.tuner import drive, make_search
from zerospeed.config.loader import load_raw
from zerospeed.config.validation import validate_config
from zerospeed.estimate.formulas import Precision
from zerospeed.profiling.trial_probe import ENV_METRIC_PATH, ENV_MODEL_INFO_PATH, write_json_atomic
from zerospeed.utils.ports import free_port
from zerospeed.zero.memory import OPTIMIZER_STATE_BYTES

logger = logging.getLogger(__name__)

ENV_DEVICE_MEMORY = "ZEROSPEED_AUTOTUNING_DEVICE_MEMORY"  # a budget per rank, e.g. "2GiB": replaces detection
# seconds per trial ("600"), or "Nx": N times the slowest successful trial so far (default: 5x, at least 60 s)
ENV_TRIAL_TIMEOUT = "ZEROSPEED_AUTOTUNING_TRIAL_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0  # until one trial has succeeded (trial.trial_timeout)
PROFILE_RUN = "profile_model_info"


class AutotuningError(Exception):
    """The autotuner cannot go on; the message says why and what to do."""


@dataclass
class TuneOutcome:
    """What `Autotuner.tune` found."""

    records: list[Record]
    best: Record | None
    seconds: float
    summary: str
    model_info: ModelInfo | None = None
    optimal_config: dict[str, Any] | None = None
    optimal_path: Path | None = None
    profile_seconds: float = 0.0
    trials: list[Record] = field(default_factory=list)


def parse_bytes(text: str) -> float:
    """'2GiB', '512MiB', '1.5GB', '1e9' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    for suffix, scale in (
        ("gib", 2**30),
        ("mib", 2**20),
        ("kib", 2**10),
        ("gb", 1e9),
        ("mb", 1e6),
        ("kb", 1e3),
        ("b", 1),
    ):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * scale
    return float(t)


def _timeout_rule(given: float | None, env: str | None) -> tuple[float | None, float, float]:
    """(fixed seconds or None, factor, floor) for `trial.trial_timeout`, from the argument or the variable."""
    if given is not None:
        return given, 5.0, 60.0
    if not env:
        return None, 5.0, 60.0
    try:
        return (None, float(env[:-1]), 0.0) if env.endswith("x") else (float(env), 5.0, 60.0)
    except ValueError:
        raise AutotuningError(
            f"{ENV_TRIAL_TIMEOUT}={env!r}: give seconds (600) or a multiple of the slowest successful trial (3x)"
        ) from None


class Autotuner:
    """Tune ZeRO stage, micro batch (and offload) for one script; see the module docstring."""

    def __init__(
        self,
        launcher_flags: list[str],
        command,
        *,
        world: TrialWorld | None = None,
        device_memory: float | None = None,
        trial_timeout: float | None = None,
        exhaustive: bool = False,
        cwd: str | Path | None = None,
        python: str = sys.executable,
    ) -> None:
        self.flags = list(launcher_flags)
        # the nodes and ranks of the trials: the launcher's resolution (`zerospeed --autotuning` passes it)
        self.world = world if world is not None else TrialWorld.from_flags(self.flags)
        self.command = command
        self.exhaustive = exhaustive  # every candidate, no model-information run, no pruning, no early stop
        self.cwd = Path(cwd or os.getcwd())
        self.python = python
        self.config_arg = cmdline.find_config(command.args)
        self.raw = load_raw(str(self._path(self.config_arg)))
        block = self.raw.get("autotuning") or {}
        self.at = validate_config({"autotuning": block}).autotuning
        self.user_block = {k: v for k, v in block.items() if k not in ("results_dir", "exps_dir")}
        self.results_dir = self._path(self.at.results_dir)
        self.exps_dir = self._path(self.at.exps_dir)
        script_values = cmdline.mapped_values(command.args, self.at.arg_mappings)
        self.base, self.space = split_space(self.raw, self.at, script_values=script_values)
        env_memory = os.environ.get(ENV_DEVICE_MEMORY)
        self.device_memory = (
            device_memory if device_memory is not None else (parse_bytes(env_memory) if env_memory else None)
        )
        self.timeout_rule = _timeout_rule(trial_timeout, os.environ.get(ENV_TRIAL_TIMEOUT))
        self.records: dict[Candidate, Record] = {}
        self.outcome: TuneOutcome | None = None
        self._ok_seconds: list[float] = []
        self._trials: list[Record] = []

    # -- the steps -----------------------------------------------------------------------------------
    def tune(self) -> TuneOutcome:
        """Plan, run the trials, write every output file; returns the outcome (best may be None)."""
        start = time.monotonic()
        self._prepare_dirs()
        info, profile_s = (None, 0.0) if self.exhaustive else self._model_info()
        budget = None if self.exhaustive else self._budget(info)
        planned = plan(self.space, info, budget, dp_size=self._dp_guess(), prune_dominated=not self.exhaustive)
        self._log_plan(planned, info, budget)
        self.records = {
            p.candidate: Record(p.candidate, NOT_RUN if p.status == OK else p.status, p.device_bytes, note=p.note)
            for p in planned
        }
        cands = [p.candidate for p in planned if p.status == OK]
        if not cands:
            raise AutotuningError(self._nothing_fits(planned, budget))
        self._search(cands)
        revived = self._revived(planned)
        if revived:  # Note [dominated candidates]: the faster twin failed, so the memory is needed after all
            logger.info("trying %d dominated configuration(s) whose faster twin failed", len(revived))
            self._search(revived)
        for r in self.records.values():
            if r.status == NOT_RUN and not r.note:
                r.note = "the search stopped before it"
        records = list(self.records.values())
        best = best_record(records, self.at.metric)
        seconds = time.monotonic() - start
        dp = info.dp_size if info else self._dp_guess()
        text = write_results(self.results_dir, records, self.at.metric, seconds, dp)
        self.outcome = TuneOutcome(
            records, best, seconds, text, info, profile_seconds=profile_s, trials=list(self._trials)
        )
        if best is not None:
            self._write_optimal(best)
        logger.info("autotuning summary (%s):\n%s", self.results_dir, text)
        if best is None:
            logger.error(
                "no trial succeeded: see the notes in %s/results.md and each trial's stderr.log", self.results_dir
            )
        return self.outcome

    def measure(self, c: Candidate) -> Record:
        """Run one configuration of the space as a trial (outside any search); its record."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.records.setdefault(c, Record(c, NOT_RUN))
        self._evaluate(c)
        return self.records[c]

    def write_optimal_config(self) -> Path | None:
        """DeepSpeed's name: ds_config_optimal.json and cmd_optimal.txt (tune() already wrote them)."""
        return self.outcome.optimal_path if self.outcome else None

    def print_tuning_results(self) -> None:
        """DeepSpeed's name: print the summary table."""
        if self.outcome:
            print(self.outcome.summary)

    def run_after_tuning(self) -> int:
        """Launch the script with the best config found (the ``run`` mode); its exit code."""
        if self.outcome is None or self.outcome.optimal_path is None:
            logger.error("no optimal configuration found by autotuning; nothing to run")
            return 1
        argv = self._argv(self.outcome.optimal_path, self.outcome.optimal_config, trial=False)
        logger.info("training with the optimal configuration: %s", " ".join(argv))
        return subprocess.run(argv, cwd=self.cwd).returncode

    # -- model information and the budget ---------------------------------------------------------------
    def _model_info(self) -> tuple[ModelInfo, float]:
        mi, path = self.at.model_info, self.at.model_info_path
        if path:
            return ModelInfo.from_profile(json.loads(self._path(path).read_text()), self.at.mp_size), 0.0
        if mi.num_params is not None and not mi.profile:
            logger.warning(
                "autotuning.model_info gives num_params: no model-information run, so the planner "
                "counts no activation memory"
            )
            return ModelInfo(
                mi.num_params, 0, self._precision_from_config(), 0.0, max(1, self._dp_guess()), self._local_memory()
            ), 0.0
        return self._profile_run()

    def _profile_run(self) -> tuple[ModelInfo, float]:
        """DeepSpeed's model-information experiment, at the candidate needing the least memory."""
        c = min_memory(self.space)
        rdir = self.results_dir / PROFILE_RUN
        cfg = trial_config(self.base, c, self.user_block or None)
        path = rdir / "model_info.json"
        result = self._launch(PROFILE_RUN, cfg, rdir, {ENV_MODEL_INFO_PATH: str(path)}, path)
        if result.status != TRIAL_OK:
            raise AutotuningError(
                f"the model-information run ({c.name}) {result.status}: {result.note}; see "
                f"{rdir}/stderr.log — the script must train with its config before it can be tuned"
            )
        logger.info("model-information run: %s in %.1f s", json.dumps(result.metrics), result.seconds)
        return ModelInfo.from_profile(result.metrics, self.at.mp_size), result.seconds

    def _budget(self, info: ModelInfo) -> float | None:
        if self.device_memory is not None:
            return self.device_memory
        return None if info.device_memory_per_rank is None else info.device_memory_per_rank * MEMORY_HEADROOM

    def _precision_from_config(self) -> Precision:
        dtype = (
            "fp16"
            if (self.raw.get("fp16") or {}).get("enabled") is True
            else ("bf16" if (self.raw.get("bf16") or {}).get("enabled") is True else "fp32")
        )
        kind = str((self.raw.get("optimizer") or {}).get("type", "adam")).lower()
        return Precision.of(dtype, kind if kind in OPTIMIZER_STATE_BYTES else "adam")

    def _local_memory(self) -> float:
        acc = get_accelerator()  # on a CPU the node's ranks share its memory
        return acc.total_memory() / (max(self.world.ranks_per_node) if acc.name == "cpu" else 1)

    def _dp_guess(self) -> int:
        """Data-parallel size of the trials' world (the model-information run measures it instead)."""
        return max(1, self.world.ranks // self.at.mp_size)

    # -- trials ----------------------------------------------------------------------------------------
    def _search(self, cands: list[Candidate]) -> None:
        tuner = "gridsearch" if self.exhaustive else self.at.tuner_type
        search = make_search(
            tuner, cands, self.at.metric, early_stopping=None if self.exhaustive else self.at.tuner_early_stopping
        )
        left = len(cands) if self.exhaustive else self.at.tuner_num_trials - len(self._trials)
        if left > 0:
            drive(search, self._evaluate, left)

    def _revived(self, planned: list[Planned]) -> list[Candidate]:
        """Dominated candidates whose named faster twin failed while no other faster twin succeeded."""
        failed = {r.candidate for r in self._trials if r.status == CRASHED}  # a hang is no memory evidence
        fine = [r.candidate for r in self._trials if r.status == TRIAL_OK]
        out = []
        for p in planned:
            c = p.candidate
            if (
                p.status == DOMINATED
                and p.dominated_by in failed
                and not any(
                    f.tier < c.tier and (f.micro_batch, f.gas, f.knobs) == (c.micro_batch, c.gas, c.knobs) for f in fine
                )
            ):
                self.records[p.candidate].status = NOT_RUN
                self.records[p.candidate].note = f"revived: {p.dominated_by.name} {self.records[p.dominated_by].status}"
                out.append(p.candidate)
        return out

    def _evaluate(self, c: Candidate) -> float | None:
        record = self.records[c]
        rdir = self.results_dir / c.name
        metric_file = rdir / "metrics.json"
        block = {**self.user_block, "metric_path": str(metric_file)}
        cfg = trial_config(self.base, c, block)
        reused = self._reuse(rdir, cfg, metric_file)
        result = reused or self._launch(c.name, cfg, rdir, {ENV_METRIC_PATH: str(metric_file)}, metric_file)
        if result.status == TRIAL_OK and not reused:
            self._ok_seconds.append(result.seconds)
        record.status, record.metrics, record.seconds = result.status, result.metrics or None, result.seconds
        record.note = "; ".join(
            n
            for n in (
                record.note if record.note.startswith("revived") else "",
                "reused (overwrite: false)" if reused else result.note,
            )
            if n
        )
        record.order = len(self._trials)
        self._trials.append(record)
        value = record.value(self.at.metric)
        shown = f"{self.at.metric} {value:.4g} {UNITS[self.at.metric]}" if value is not None else result.note
        logger.info("trial %d %s: %s, %s (%.1f s)", record.order + 1, c.name, result.status, shown, result.seconds)
        return value

    def _reuse(self, rdir: Path, cfg: dict[str, Any], metric_file: Path) -> TrialResult | None:
        """overwrite: false — a trial whose config and metrics are on disk is not run again."""
        if self.at.overwrite or not metric_file.exists():
            return None
        try:
            same = json.loads((rdir / "ds_config.json").read_text()) == cfg
            metrics = json.loads(metric_file.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return TrialResult(TRIAL_OK, 0.0, 0, metrics) if same else None

    def _launch(
        self, name: str, cfg: dict[str, Any], rdir: Path, env_extra: dict[str, str], out_file: Path
    ) -> TrialResult:
        rdir.mkdir(parents=True, exist_ok=True)
        config_path = rdir / "ds_config.json"
        config_path.write_text(json.dumps(cfg, indent=2) + "\n")
        argv = self._argv(config_path, cfg, trial=True)
        exp = {
            "name": name,
            "ds_config": cfg,
            "launcher_args": self.flags,
            "script": self.command.script,
            "user_args": list(self.command.args),
            "result_dir": str(rdir),
        }
        write_json_atomic(self.exps_dir / f"{name}.json", exp)
        (rdir / "exp.json").write_text(json.dumps(exp, indent=2) + "\n")
        env = {**os.environ, **env_extra}
        fixed, factor, floor = self.timeout_rule
        timeout = fixed or trial_timeout(self._ok_seconds, DEFAULT_TIMEOUT_S, factor=factor, floor=floor)
        return run_trial(argv, rdir, env=env, timeout=timeout, metric_file=out_file, cwd=str(self.cwd))

    def _argv(self, config_path: Path, cfg: dict[str, Any], *, trial: bool) -> list[str]:
        flags = list(self.flags)
        if trial and self._single_local_node():
            flags.append(f"--master_port={free_port()}")  # trials follow each other; no stale port between them
        args = cmdline.replace_config(self.command.args, self.config_arg, str(config_path))
        args = cmdline.apply_mappings(args, self.at.arg_mappings, cfg)
        return [self.python, "-m", "zerospeed.launcher", *flags, self.command.script, *args]

    def _single_local_node(self) -> bool:
        multi = ("--master_port", "--master_addr", "--hostfile", "-H", "--num_nodes", "--node_rank", "--include")
        return not any(cmdline.has_flag(self.flags, f) for f in multi) and not self.world.hostfile

    # -- files ------------------------------------------------------------------------------------------
    def _path(self, p: str | Path) -> Path:
        p = Path(p)
        return p if p.is_absolute() else self.cwd / p

    def _prepare_dirs(self) -> None:
        if self.at.overwrite:
            for d in (self.results_dir, self.exps_dir):
                shutil.rmtree(d, ignore_errors=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.exps_dir.mkdir(parents=True, exist_ok=True)

    def _write_optimal(self, best: Record) -> None:
        cfg = trial_config(self.base, best.candidate)
        path = self.results_dir / "ds_config_optimal.json"
        argv = self._argv(path, cfg, trial=False)
        self.outcome.optimal_path = write_optimal(self.results_dir, cfg, argv)
        self.outcome.optimal_config = cfg
        logger.info(
            "best: %s (%s %.4g %s); wrote %s and cmd_optimal.txt",
            best.candidate.name,
            self.at.metric,
            best.value(self.at.metric),
            UNITS[self.at.metric],
            path,
        )

    def _log_plan(self, planned: list[Planned], info: ModelInfo | None, budget: float | None) -> None:
        counts: dict[str, int] = {}
        for p in planned:
            counts[p.status] = counts.get(p.status, 0) + 1
        if info is not None:
            logger.info(
                "model: %s parameters, %.1f MiB of activations per sample, data-parallel size %d; "
                "device budget %s per rank",
                f"{info.num_params:,}",
                info.activation_bytes_per_sample / 2**20,
                info.dp_size,
                f"{budget / 2**30:.2f} GiB" if budget else "unlimited",
            )
        logger.info(
            "tuning space: %d configurations: %s",
            len(planned),
            ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        )

    def _nothing_fits(self, planned: list[Planned], budget: float | None) -> str:
        if not planned:
            return (
                "the tuning space is empty: check zero_optimization.stage, the offload devices and the "
                "micro-batch bounds (min/max_train_micro_batch_size_per_gpu, min/max_train_batch_size)"
            )
        smallest = min(planned, key=lambda p: p.device_bytes)
        return (
            f"no configuration fits the device: the smallest, {smallest.candidate.name}, needs "
            f"{smallest.device_bytes / 2**30:.2f} GiB per rank, the budget is {(budget or 0) / 2**30:.2f} GiB; "
            'allow higher ZeRO stages or offload (zero_optimization.stage: "all", offload_optimizer.device: '
            '["none", "cpu"]) or more ranks'
        )
