"""zerospeed's logger and DeepSpeed's `log_dist`: a job's set-up messages appear once, not once per rank.

Note [rank-0 logging]: every rank runs the same set-up (config, optimizer, scheduler), so a plain
module logger would print each message world-size times. DeepSpeed logs such messages with
`log_dist(msg, ranks=[0])`. Here a module logger made by `get_logger(__name__)` carries a
`RankFilter`: a record below ERROR passes on rank 0 only, unless it names its ranks with
`extra={"ranks": [...]}` (`[-1]`: every rank) because its text differs between ranks. Errors always
pass: a failing rank must say why. The rank is torch.distributed's once initialised, else `$RANK`
(set by the launcher); a process with neither is a single process and logs everything.

Handlers and levels stay the application's choice (`logging.basicConfig`): zerospeed adds none.
Nothing here imports torch: torch.distributed is consulted only when already imported.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["RankFilter", "current_rank", "get_logger", "log_dist", "logger", "should_log"]


def current_rank() -> int | None:
    """This process's global rank: torch.distributed's when initialised, else $RANK, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK", "")
    return int(env) if env.isdigit() else None


def should_log(ranks: Sequence[int], rank: int | None) -> bool:
    """True on a listed rank, on every rank when `ranks` starts with -1, and in a single process."""
    return rank is None or (bool(ranks) and (ranks[0] == -1 or rank in ranks))


class RankFilter(logging.Filter):
    """Passes a record on the ranks in its `ranks` attribute (default [0]); ERROR and above everywhere."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return should_log(getattr(record, "ranks", (0,)), current_rank())


def get_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` with a `RankFilter` (Note [rank-0 logging]); idempotent."""
    log = logging.getLogger(name)
    if not any(isinstance(f, RankFilter) for f in log.filters):
        log.addFilter(RankFilter())
    return log


logger = get_logger("zerospeed")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `log_dist`: log ``[Rank r] message`` on the ranks in ``ranks`` (``[-1]``: all).

    As in DeepSpeed, a single process (no process group, no $RANK) always logs, as rank -1, and once
    distributed ``ranks=None`` logs nowhere.
    """
    rank = current_rank()
    if should_log(list(ranks or ()), rank):
        logger.log(level, "[Rank %d] %s", -1 if rank is None else rank, message, extra={"ranks": [-1]}, stacklevel=2)
