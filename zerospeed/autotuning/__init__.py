"""The autotuner (``zerospeed --autotuning tune|run``, docs/autotuning.md): DeepSpeed's config block and
outputs, with a planner that lets the memory estimator discard what cannot fit before any trial runs,
and trials that cannot hang the search.

    space.py     the tuning lists of a config -> candidates (pure)
    planner.py   estimate, prune, dominance, order (pure)
    tuner.py     gridsearch / random / model_based searches as generators (pure)
    command.py   the trials' command lines, and the world they run on as the launcher resolved it (pure)
    trial.py     one trial: its own process group, a time limit, the metric file
    results.py   records, results.md / .csv, summary.txt, ds_config_optimal.json
    autotuner.py Autotuner: the steps in order;  cli.py: what the launcher calls (`autotune`)

The trial side, what a training process measures when a trial started it, is a profiling tool
(zerospeed/profiling/trial_probe.py) that the engine's observer runs; this package only reads its files.
"""

from __future__ import annotations

import importlib

from zerospeed.deepspeed_paths import package_getattr

__all__ = ["Autotuner", "AutotuningError", "TrialWorld", "TuneOutcome", "autotune"]
_HOMES = {
    "Autotuner": "autotuner",
    "AutotuningError": "autotuner",
    "TuneOutcome": "autotuner",
    "TrialWorld": "command",
    "autotune": "cli",
}
_submodule = package_getattr(__name__)


def __getattr__(name: str):
    # Note [the autotuner loads on use]: the `zerospeed` command imports this package at start-up and
    # must not import torch (the launcher's start-up time); the tuner's modules (torch, the estimator)
    # load when one of these names is first used.
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    return _submodule(name)
