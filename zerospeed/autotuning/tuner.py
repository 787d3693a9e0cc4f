"""Search strategies (pure): which candidate to try next, given the metrics measured so far.

A search is a generator: it yields a `Candidate` and is sent back that trial's metric value, or None
when the trial crashed, timed out or wrote no metric (such a trial is skipped: it never ends a search
and never counts as worse). `drive` runs one against any function of a candidate, so the strategies
are tested without processes.

- ``gridsearch``: the planner's order (fastest tier, largest micro batch, lowest stage first), stopped
  ``tuner_early_stopping`` trials after the best so far (DeepSpeed's rule) or when the space ends.
- ``random``: the same, in a seeded random order.
- ``model_based``: Note [model-based search]. DeepSpeed fits an XGBoost cost model; zerospeed's model
  is structural, from what the planner knows:

  Note [model-based search]: per tier (`Candidate.tier`, fastest first) the micro batch is searched
  on the tier's first variant (lowest stage) from the largest size that fits downwards, stopping at
  the first size that is worse (throughput is unimodal in the micro batch: it grows while the device
  fills, then falls). The tier's other variants (stages, offload devices, knobs) are then tried in
  order, each from its own largest size down to the best size so far (a higher stage fits larger
  micro batches), and the sweep stops at the first variant that is not better — DeepSpeed's rule for
  ZeRO stages. A slower tier is searched only while it improves on the faster ones; with dominated
  candidates removed it holds only micro batches the faster tiers cannot fit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Iterable
from itertools import groupby

from zerospeed.autotuning.space import Candidate

Search = Generator[Candidate, "float | None", None]
TUNER_TYPES = ("gridsearch", "random", "model_based")


def better(a: float, b: float, metric: str) -> bool:
    """Whether metric value ``a`` beats ``b``: lower latency, higher throughput or FLOPS."""
    return a < b if metric == "latency" else a > b


def ordered(order: Iterable[Candidate], metric: str, early_stopping: int | None) -> Search:
    """Try ``order`` in turn; stop ``early_stopping`` trials past the best (None: never)."""
    best, best_at = None, -1
    for i, c in enumerate(order):
        value = yield c
        if value is not None and (best is None or better(value, best, metric)):
            best, best_at = value, i
        if early_stopping is not None and best is not None and i - best_at >= early_stopping:
            return


def _descend(cands: list[Candidate], metric: str):
    """Largest micro batch first, down while it improves; returns (candidate, value) or None."""
    best = None
    for c in sorted(cands, key=lambda c: -c.micro_batch):
        value = yield c
        if value is None:
            continue
        if best is not None and not better(value, best[1], metric):
            break
        best = (c, value)
    return best


def model_based(cands: list[Candidate], metric: str) -> Search:
    """Note [model-based search]."""
    best = None
    for _, tier in groupby(sorted(cands, key=lambda c: c.tier), key=lambda c: c.tier):
        tier = list(tier)
        order = sorted({c.variant for c in tier}, key=lambda v: (v[0], v[1], v[2], tier_index(tier, v)))
        tier_best, rest = None, list(order)
        while tier_best is None and rest:  # a variant whose every trial failed: descend the next one
            variant = rest.pop(0)
            tier_best = yield from _descend([c for c in tier if c.variant == variant], metric)
        if tier_best is None:
            continue
        for variant in rest:
            # from this variant's largest size down to the best so far (a higher stage may fit larger ones)
            sizes = [c for c in tier if c.variant == variant and c.micro_batch >= tier_best[0].micro_batch]
            found = yield from _descend(sizes, metric)
            if found is None:
                continue
            if not better(found[1], tier_best[1], metric):
                break
            tier_best = found
        if best is not None and not better(tier_best[1], best[1], metric):
            return
        best = tier_best


def tier_index(tier: list[Candidate], variant: tuple) -> int:
    """Position of a variant's first candidate: knob values keep the order the user listed them in."""
    return next(i for i, c in enumerate(tier) if c.variant == variant)


def make_search(
    tuner_type: str, cands: list[Candidate], metric: str, *, early_stopping: int | None, seed: int = 0
) -> Search:
    """The search of ``tuner_type`` over ``cands`` (in the planner's order)."""
    if tuner_type == "gridsearch":
        return ordered(cands, metric, early_stopping)
    if tuner_type == "random":
        shuffled = list(cands)
        random.Random(seed).shuffle(shuffled)
        return ordered(shuffled, metric, early_stopping)
    if tuner_type == "model_based":
        return model_based(cands, metric)
    raise ValueError(f"tuner_type must be one of {', '.join(TUNER_TYPES)}, got {tuner_type!r}")


def drive(search: Search, evaluate: Callable[[Candidate], float | None], max_trials: int) -> list[Candidate]:
    """Run ``search`` with ``evaluate`` for at most ``max_trials`` trials; the candidates tried, in order."""
    tried: list[Candidate] = []
    try:
        c = next(search)
        while True:
            tried.append(c)
            value = evaluate(c)
            if len(tried) >= max_trials:
                break
            c = search.send(value)
    except StopIteration:
        pass
    return tried
