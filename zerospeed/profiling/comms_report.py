"""The comms logger's report, built on the gateway's counters (`zerospeed.comm.STATS`).

Per collective kind: calls, payload bytes, mean latency, algorithmic bandwidth (payload / time) and
bus bandwidth (bytes one rank puts on the wire under a ring algorithm / time: all-reduce 2(N-1)/N of
the payload, the others (N-1)/N), which is comparable across kinds and world sizes.
"""

from __future__ import annotations


def diff_snapshots(after: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """Counters accumulated between two `CommStats.snapshot()`s (kinds absent before count from 0)."""
    out = {}
    for kind, a in after.items():
        b = before.get(kind, {})
        d = {k: a[k] - b.get(k, 0) for k in ("calls", "payload_bytes", "wire_bytes", "seconds")}
        if d["calls"]:
            out[kind] = d
    return out


def comm_rows(snapshot: dict[str, dict], kinds: list[str] | None = None) -> list[dict]:
    """One row per kind: calls, MB, mean ms, algbw and busbw in GB/s; `kinds` filters (prof_ops)."""
    rows = []
    for kind in sorted(snapshot):
        if kinds and kind not in kinds:
            continue
        s = snapshot[kind]
        secs = s["seconds"]
        rows.append(
            {
                "kind": kind,
                "calls": s["calls"],
                "MB": s["payload_bytes"] / 1e6,
                "mean_ms": 1e3 * secs / s["calls"] if s["calls"] else 0.0,
                "algbw_GBps": s["payload_bytes"] / secs / 1e9 if secs > 0 else 0.0,
                "busbw_GBps": s["wire_bytes"] / secs / 1e9 if secs > 0 else 0.0,
            }
        )
    return rows


def format_comm_report(snapshot: dict[str, dict], kinds: list[str] | None = None) -> str:
    """A table of `comm_rows`."""
    lines = [f"{'collective':<16}{'calls':>8}{'MB':>12}{'mean ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in comm_rows(snapshot, kinds):
        lines.append(
            f"{r['kind']:<16}{r['calls']:>8}{r['MB']:>12.3f}{r['mean_ms']:>10.3f}"
            f"{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
        )
    return "\n".join(lines)
