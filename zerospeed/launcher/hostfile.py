"""Hostfile parsing: the MPI-style list of hosts and their slot counts (``worker-0 slots=8``)."""

from __future__ import annotations

import os
import re

from zerospeed.launcher.errors import LauncherError

# DeepSpeed's default location (set by some cluster schedulers). When the user did not pass
# --hostfile and this file is missing, the job runs on the local machine only.
DEFAULT_HOSTFILE = "/job/hostfile"

EXPECTED_FORMAT = "expected 'HOSTNAME slots=N' with N >= 1 (e.g. 'worker-0 slots=8'); '#' starts a comment"

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)$")


def parse_hostfile(text: str, *, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile text into ``{host: slots}`` in file order.

    Each non-blank line is ``HOSTNAME slots=N``; ``#`` starts a comment (whole line or trailing).
    A malformed line, ``slots=0``, a host listed twice or a file without hosts raises
    ``LauncherError`` naming ``source`` and the line number.
    """
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None or int(match["slots"]) < 1:
            raise LauncherError(f"{source}:{lineno}: bad line {raw.strip()!r}: {EXPECTED_FORMAT}")
        host = match["host"]
        if host in hosts:
            raise LauncherError(
                f"{source}:{lineno}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "list each host once with its total slot count"
            )
        hosts[host] = int(match["slots"])
        first_line[host] = lineno
    if not hosts:
        raise LauncherError(f"{source}: no hosts found; {EXPECTED_FORMAT}")
    return hosts


def read_hostfile(path: str | None) -> dict[str, int] | None:
    """Read and parse a hostfile.

    ``path=None`` means "the user did not pass --hostfile": the default path is tried and, when it
    does not exist, ``None`` is returned (run on this machine only). A path the user named must
    exist.
    """
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        path = DEFAULT_HOSTFILE
    if not os.path.isfile(path):
        raise LauncherError(f"--hostfile {path!r} does not exist; {EXPECTED_FORMAT}")
    with open(path, encoding="utf-8") as f:
        return parse_hostfile(f.read(), source=path)
