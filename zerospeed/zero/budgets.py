"""Transient-buffer sizes bounded by the model (pure).

Note [buckets bounded by the model]: DeepSpeed's defaults size the transient buffers for models of
billions of parameters — `reduce_bucket_size` 5e8 elements (2 GB of fp32 staging per bucket),
`stage3_prefetch_bucket_size` 5e7, `stage3_max_reuse_distance` 1e9. On any smaller model one bucket
is the whole gradient: stage 2 stages every gradient in full until the end of backward (no less than
stage 1's persistent buffer), stage 3 fuses the whole model's gradients into one reduce-scatter (the
full gradient plus its concatenated copy at the end of backward) and keeps every unit it used in
forward gathered until that unit's backward (the whole model again). That is why stage 3 used to
peak above stage 0. Each of these keys therefore keeps its meaning as an upper bound, and the size
used is at most 1/BUCKETS_PER_MODEL of the trainable elements (never below MIN_BUCKET elements, so
that small models still travel in few collectives; a parameter or unit larger than that travels
alone, as before). Reduction and prefetch still overlap compute with BUCKETS_PER_MODEL buckets in a
step; what is transient is bounded by a fixed fraction of the model instead of by the defaults.

Note [stage-3 gather window floor]: stage 3's gathered window (the prefetch look-ahead and the reuse
distance) is never cut below MIN_GATHER_WINDOW elements (32 MiB of fp32). Below that the memory saved
is small in absolute terms, and what cutting it costs is not: each unit released after its forward is
gathered again in its backward, which doubles the all-gather bytes and calls. On a 4.2M-parameter GPT
(4 x 256, 2 gloo ranks) the 1/8 bound made a step 1.12x slower than keeping the window at the floor
(benchmarks/bench_step.py, docs/benchmarks.md), for 13 MB per rank. Models of more than
8 x MIN_GATHER_WINDOW elements are bounded by the 1/8 rule as before; an explicitly smaller
`stage3_prefetch_bucket_size` / `stage3_max_reuse_distance` is always honoured (the bound is a cap).
"""

from __future__ import annotations

from dataclasses import dataclass

BUCKETS_PER_MODEL = 8
MIN_BUCKET = 1 << 20  # elements: 4 MiB of fp32
MIN_GATHER_WINDOW = 1 << 23  # elements: 32 MiB of fp32 (Note [stage-3 gather window floor])


def model_bound(trainable_elements: int) -> int:
    """The largest transient bucket, in elements, for a model of this many trainable elements."""
    return max(MIN_BUCKET, -(-trainable_elements // BUCKETS_PER_MODEL))


@dataclass(frozen=True)
class Budgets:
    reduce_bucket: int  # elements per gradient reduction bucket (stages 1-3)
    prefetch_bucket: int  # elements gathered ahead of use (stage 3)
    reuse_distance: int  # elements of other gathers within which a used unit stays gathered (stage 3)


def bounded_budgets(
    trainable_elements: int,
    *,
    reduce_bucket_size: int,
    prefetch_bucket_size: int = 0,
    max_reuse_distance: int = 0,
    gathered_elements: int | None = None,
) -> Budgets:
    """The sizes used: the configured ones, capped by `model_bound` (Note [buckets bounded by the model]) —
    gradient buckets by the trainable elements, stage 3's gathers by `gathered_elements` (every parameter
    stage 3 partitions, frozen ones included; default: the trainable ones) and never below
    MIN_GATHER_WINDOW (Note [stage-3 gather window floor])."""
    cap = model_bound(trainable_elements)
    gathered = trainable_elements if gathered_elements is None else gathered_elements
    gathers = max(MIN_GATHER_WINDOW, model_bound(gathered))  # Note [stage-3 gather window floor]
    return Budgets(min(reduce_bucket_size, cap), min(prefetch_bucket_size, gathers), min(max_reuse_distance, gathers))
