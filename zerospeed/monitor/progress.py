"""A training progress display: one live tqdm bar in a terminal, a few plain lines in a file or CI log.

tqdm redraws its bar in place with carriage returns; written to a file, every redraw becomes another
fragment of one endless line. So the bar is live only when its stream is a terminal; otherwise
`Progress` prints a complete line (tqdm's own meter text, without the bar) every ``total / lines``
updates and at the last one. Enable it on one rank (rank 0) to get one display per job.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Self, TextIO

from tqdm import tqdm

__all__ = ["Progress"]

LINE_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _is_terminal(stream: TextIO) -> bool:
    """A terminal with a width: a pseudo-terminal of 0 columns (some CI runners) would show no bar."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # no isatty/fileno, a closed stream, no size
        return False


class Progress:
    """``update(postfix)`` once per step; ``close()`` (or use it as a context manager) at the end."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        enabled: bool = True,
        unit: str = "step",
        lines: int = 10,
        file: TextIO | None = None,
        clock=time.perf_counter,
    ):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.file = file if file is not None else sys.stderr  # where tqdm writes by default
        self.live = enabled and _is_terminal(self.file)
        self.every = max(1, -(-total // max(1, lines)))  # ceil: at most `lines` lines, plus the last
        self.n = 0
        self._clock = clock
        self._start = clock()
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True) if self.live else None

    def update(self, postfix: str = "") -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)
        elif self.enabled and (self.n % self.every == 0 or self.n == self.total):
            line = tqdm.format_meter(
                self.n,
                self.total,
                self._clock() - self._start,
                prefix=self.desc,
                unit=self.unit,
                postfix=postfix or None,
                bar_format=LINE_FORMAT,
            )
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
