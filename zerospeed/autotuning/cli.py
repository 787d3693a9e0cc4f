"""``zerospeed --autotuning tune|run script.py --deepspeed ds_config.json``: what the launcher calls.

``tune`` searches and writes ``results_dir`` (ds_config_optimal.json, cmd_optimal.txt, results.md,
results.csv, summary.txt, one folder per trial); ``run`` tunes, then trains with the best config.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from zerospeed.autotuning.autotuner import Autotuner, AutotuningError
from zerospeed.autotuning.command import TrialWorld, launcher_flags
from zerospeed.utils.errors import ConfigError

logger = logging.getLogger(__name__)
MODES = ("tune", "run")


def autotune(mode: str, argv: Sequence[str], command, world: TrialWorld | None = None) -> int:
    """Run the autotuner for the launcher's ``argv`` (its flags, then the script and its arguments in
    ``command``) on ``world`` (the launcher's nodes and ranks; read from the flags when None); the exit
    code: 0 when a best config was found (and, for run, training succeeded)."""
    if mode not in MODES:
        print(f"zerospeed: error: --autotuning must be one of {', '.join(MODES)}, got {mode!r}", file=sys.stderr)
        return 2
    flags = launcher_flags(argv, 1 + len(command.args))
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so the running trial's process group is killed too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        tuner = Autotuner(flags, command, world=world)
        outcome = tuner.tune()
    except ConfigError as err:
        print(f"zerospeed: error: {err}", file=sys.stderr)
        return 2
    except AutotuningError as err:
        print(f"zerospeed: autotuning failed: {err}", file=sys.stderr)
        return 1
    if outcome.best is None:
        return 1
    return tuner.run_after_tuning() if mode == "run" else 0
