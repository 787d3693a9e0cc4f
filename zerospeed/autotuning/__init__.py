"""The autotuner (``zerospeed --autotuning tune|run``, docs/autotuning.md): DeepSpeed's config block and
outputs, with a planner that lets the memory estimator discard what cannot fit before any trial runs,
and trials that cannot hang the search.

    space.py     the tuning lists of a config -> candidates (pure)
    planner.py   estimate, prune, dominance, order (pure)
    tuner.py     gridsearch / random / model_based searches as generators (pure)
    trial.py     one trial: its own process group, a time limit, the metric file
    probe.py     the trial side: what the engine measures when the autotuner launched it
    results.py   records, results.md / .csv, summary.txt, ds_config_optimal.json
    autotuner.py Autotuner: the steps in order;  cli.py: what the launcher calls
"""
from __future__ import annotations

import importlib

from zerospeed.deepspeed_paths import package_getattr

__all__ = ["Autotuner", "AutotuningError", "TuneOutcome"]
_submodule = package_getattr(__name__)


def __getattr__(name: str):
    # lazy: the engine imports probe.py from every training process; the rest is the launcher's
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.autotuner"), name)
    return _submodule(name)
