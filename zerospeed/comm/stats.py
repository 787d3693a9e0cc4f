"""Per-collective counters of the comm gateway: calls, bytes, time, and bytes on the wire.

`payload` is the size of the full tensor a collective works on (all-reduce: the tensor; reduce-scatter:
the input; all-gather: the output). `wire` is what one rank sends under the ring algorithms that
NCCL and gloo use for large tensors: all-reduce 2(N-1)/N of the payload, reduce-scatter and
all-gather (N-1)/N, broadcast (N-1)/N, all-to-all (N-1)/N (exact for uneven splits: all but the slice
a rank keeps); a point-to-point send carries its payload once (a receive
sends nothing). Time runs from issue to the moment the result is usable
(`wait()` for async collectives), so overlapped collectives show their latency, not lost time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def wire_fraction(kind: str, world_size: int) -> float:
    """Bytes one rank sends per payload byte, for a ring implementation of `kind`."""
    if kind in ("send", "recv", "isend", "irecv"):
        return 1.0 if kind in ("send", "isend") else 0.0  # point to point: the sender carries the bytes
    if world_size <= 1:
        return 0.0
    share = (world_size - 1) / world_size
    return 2 * share if kind == "all_reduce" else share


@dataclass
class KindStats:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class CommStats:
    kinds: dict[str, KindStats] = field(default_factory=dict)

    def record(self, kind: str, nbytes: int, seconds: float, world_size: int, wire_bytes: float | None = None) -> None:
        """Count one collective; `wire_bytes` overrides the ring estimate where the exact figure is known
        (an uneven all-to-all sends everything but the slice a rank keeps)."""
        k = self.kinds.setdefault(kind, KindStats())
        k.calls += 1
        k.payload_bytes += nbytes
        k.wire_bytes += nbytes * wire_fraction(kind, world_size) if wire_bytes is None else wire_bytes
        k.seconds += seconds

    def reset(self) -> None:
        self.kinds.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A plain-dict copy: {kind: {calls, payload_bytes, wire_bytes, seconds, algbw_GBps}}."""
        out = {}
        for kind, k in self.kinds.items():
            out[kind] = {
                "calls": k.calls,
                "payload_bytes": k.payload_bytes,
                "wire_bytes": k.wire_bytes,
                "seconds": k.seconds,
                "algbw_GBps": k.payload_bytes / k.seconds / 1e9 if k.seconds > 0 else 0.0,
            }
        return out

    def total_wire_bytes(self) -> float:
        return sum(k.wire_bytes for k in self.kinds.values())
