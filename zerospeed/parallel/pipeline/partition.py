"""Pure partitioning of a layer list into pipeline parts: bounds [b0=0, b1, ..., bP=n].

Part k holds layers [bounds[k], bounds[k+1]). `partition_uniform` and `partition_balanced` are
DeepSpeed's `runtime.utils` functions, with its results: fewer items than parts gives empty parts
(bounds [0, 1, ..., n, n, ...]). A pipeline stage needs a layer, so `partition` (what PipelineModule
calls) refuses that case with a ConfigError.
"""

from __future__ import annotations

import re

from zerospeed.utils.errors import ConfigError


def _check(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"need at least one part, got {num_parts}")
    if num_items < num_parts:
        raise ConfigError(
            f"cannot split {num_items} layers into {num_parts} pipeline parts: every stage "
            "(and virtual stage) needs at least one layer; use fewer stages or more layers"
        )


def prefix_sum_inc(weights: list[float]) -> list[float]:
    """Inclusive prefix sums: [w0, w0 + w1, ...] (DeepSpeed's `runtime.utils.prefix_sum_inc`)."""
    sums: list[float] = []
    for w in weights:
        sums.append(w + sums[-1] if sums else w)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal item counts; the first `num_items % num_parts` parts get one item more. With no more items
    than parts, part k < num_items holds item k and the rest are empty (DeepSpeed's bounds)."""
    if num_parts < 1:
        raise ValueError(f"need at least one part, got {num_parts}")
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Contiguous parts of the least spread (heaviest part minus lightest), DeepSpeed's criterion.

    An exact dynamic programme over (items, parts); among equally good splits the last one found (the
    latest cut of each part) wins, as in DeepSpeed, so the bounds equal DeepSpeed's. No more items than
    parts: `partition_uniform`'s bounds.
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"need at least one part, got {num_parts}")
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # for the first i items in k parts: (spread, heaviest, lightest) of the best split, and its last cut
    best: list[list[tuple[float, float, float] | None]] = [[None] * (num_parts + 1) for _ in range(n + 1)]
    cut = [[0] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for k in range(1, min(i, num_parts) + 1):
            for j in range(i):
                prev = best[j][k - 1]
                if prev is None:
                    continue
                part = prefix[i] - prefix[j]
                high, low = max(prev[1], part), min(prev[2], part)
                if best[i][k] is None or high - low <= best[i][k][0]:  # '<=': the latest cut wins ties
                    best[i][k], cut[i][k] = (high - low, high, low), j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[bounds[-1]][k])
    return bounds[::-1]


def partition_by_type(class_names: list[str], pattern: str, num_parts: int) -> list[int]:
    """Spread the layers whose class name matches `pattern` (case-insensitive) evenly over the parts.

    Part k (k >= 1) starts at its first matching layer; unmatched layers stay with the matching
    layer before them (part 0 also takes any leading ones).
    """
    regex = re.compile(pattern, re.IGNORECASE)
    matched = [i for i, name in enumerate(class_names) if regex.search(name)]
    if len(matched) < num_parts:
        raise ConfigError(
            f"partition_method 'type:{pattern}': {len(matched)} layer(s) match "
            f"({sorted(set(class_names))}), fewer than the {num_parts} parts to fill"
        )
    counts = partition_uniform(len(matched), num_parts)
    return [0] + [matched[counts[k]] for k in range(1, num_parts)] + [len(class_names)]


def partition(method: str, *, class_names: list[str], param_counts: list[int], num_parts: int) -> list[int]:
    """Dispatch on DeepSpeed's method names: uniform, parameters (alias best), type:REGEX."""
    low = method.lower()
    if low in ("uniform", "parameters", "best"):
        _check(len(class_names), num_parts)
    if low == "uniform":
        return partition_uniform(len(class_names), num_parts)
    if low in ("parameters", "best"):
        return partition_balanced([float(c) for c in param_counts], num_parts)
    if low.startswith("type:"):
        return partition_by_type(class_names, method[len("type:") :], num_parts)
    raise ConfigError(f"partition_method={method!r}: unknown method; use 'uniform', 'parameters' or 'type:<regex>'")
