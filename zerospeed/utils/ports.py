"""Free TCP ports for rendezvous stores and test daemons (standard library only).

Note [ports outside the ephemeral range]
The usual way to find a free port, binding port 0 and closing the socket, returns a port from the
kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default).
That is the range the kernel also hands every *outgoing* connection as its local port. Between
picking the port and the store's listen(), any other process on the host that connects somewhere
(another job's ranks reaching their store, an ssh or srun connection, a pip download) can be given
that same port as its local end, and the listen then fails with EADDRINUSE. This happened in CI,
where one test starts five launcher jobs at once: slurm's node 0 could not host its store on the
port picked for it a second earlier. Ports the kernel never assigns on its own cannot be taken this
way, so `free_port` draws at random from outside the ephemeral range (20000 up to its start, and
above its end), skips ports this process already handed out, and checks that the port binds on
every address asked for (on 0.0.0.0 by default: a listener there conflicts with one on any
address). Another program that picks the same port by itself in the gap can still collide; at
random over ~12,000 ports, two concurrent picks collide with odds of about 1 in 12,000. Where the
kernel leaves no room outside its range, it falls back to binding port 0.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_DEFAULT = (32768, 60999)
_LOWEST = 20000  # below: registered services (databases, dev servers) more often listen without warning
_ISSUED: set[int] = set()
_TRIES = 500


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default where unknown)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return _LINUX_DEFAULT


def _windows() -> list[tuple[int, int]]:
    lo, hi = ephemeral_range()
    windows = []
    if lo - 1 >= _LOWEST:
        windows.append((_LOWEST, lo - 1))
    if hi + 1 <= 65535:
        windows.append((max(hi + 1, _LOWEST), 65535))
    return [w for w in windows if w[1] - w[0] >= 100]


def bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind (host, port) now (no SO_REUSEADDR: a port in TIME_WAIT counts as taken)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(hosts: Sequence[str] = ("0.0.0.0",)) -> int:
    """A TCP port that binds on every one of ``hosts``, outside the ephemeral range; see the module's Note."""
    rng = random.SystemRandom()  # not the global generator: seeded tests must not all draw the same port
    windows = _windows()
    weights = [b - a + 1 for a, b in windows]
    for _ in range(_TRIES if windows else 0):
        a, b = rng.choices(windows, weights)[0]
        port = rng.randint(a, b)
        if port not in _ISSUED and all(bindable(h, port) for h in hosts):
            _ISSUED.add(port)
            return port
    while True:  # no room outside the ephemeral range (or all of it busy): let the kernel choose
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        if port not in _ISSUED and all(bindable(h, port) for h in hosts[1:]):
            _ISSUED.add(port)
            return port
