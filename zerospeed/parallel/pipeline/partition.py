"""Pure partitioning of a layer list into pipeline parts: bounds [b0=0, b1, ..., bP=n].

Part k holds layers [bounds[k], bounds[k+1]). Every part gets at least one layer.
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


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal layer counts; the first `num_items % num_parts` parts get one layer more."""
    _check(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising the heaviest part's total weight (exact dynamic programme).

    Among equally good splits the one whose later parts are lighter wins (the last stage also
    computes the loss).
    """
    n = len(weights)
    _check(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest possible heaviest part when the first i items form k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:  # '<=' prefers the latest cut: a lighter last part
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
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
    if low == "uniform":
        return partition_uniform(len(class_names), num_parts)
    if low in ("parameters", "best"):
        return partition_balanced([float(c) for c in param_counts], num_parts)
    if low.startswith("type:"):
        return partition_by_type(class_names, method[len("type:") :], num_parts)
    raise ConfigError(f"partition_method={method!r}: unknown method; use 'uniform', 'parameters' or 'type:<regex>'")
