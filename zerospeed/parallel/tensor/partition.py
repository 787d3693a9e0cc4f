"""Pure math of tensor-parallel slicing: which rows or columns of a full weight each tp rank holds.

Everything here is a function of integers (and, for `take` / `assemble`, of tensors already in
hand): no process group is consulted, so the layouts are unit-tested exactly and any rank can compute
any other rank's layout (which is how a full tensor is put back together from its shards).

Conventions: weights are in nn.Linear layout [out, in]; a *column*-parallel layer splits dim 0 (its
outputs), a *row*-parallel layer dim 1 (its inputs); an embedding [vocab, dim] splits dim 0.

Note [fused and head-aware layouts]: a fused projection (GPT-2's `c_attn` = [q | k | v]) is several
sub-weights stacked along the output dimension; each rank takes its slice of *every* sub-weight, so
its local output is [q_r | k_r | v_r] and the model's own `split` still works with local sizes.
Attention projections split by whole heads; with grouped-query attention and tp > kv heads the kv
heads cannot be split further, so each rank holds the one kv head its query heads use, replicated on
the tp/kv ranks that share it (their gradients are summed over those replicas; see layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# ShardSpec, take and assemble are the checkpoint's vocabulary as much as ours: they live below both
from zerospeed.checkpoint.slices import ShardSpec, Specs, assemble, take  # noqa: F401 (re-exported)


def valid_tp_sizes(*counts: int, limit: int = 64) -> list[int]:
    """The tp sizes (up to `limit`) that divide every count."""
    return [p for p in range(1, limit + 1) if all(c % p == 0 for c in counts)]


def check_divisible(what: str, count: int, tp: int) -> None:
    """Raise a clear error when `count` (e.g. "num_attention_heads of layers.0.attn") cannot be split
    over `tp` ranks, listing the tp sizes that would work."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if count % tp:
        raise ValueError(
            f"{what} = {count} is not divisible by the tensor-parallel size {tp}; "
            f"valid tp sizes: {valid_tp_sizes(count, limit=min(count, 64))}"
        )


def even_range(count: int, tp: int, rank: int, what: str = "size") -> tuple[int, int]:
    """(start, length) of rank's equal share of `count` items (count must divide by tp)."""
    check_divisible(what, count, tp)
    n = count // tp
    return rank * n, n


def balanced_range(count: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's share when `count` need not divide: the first count % tp ranks take one
    more (used for vocabularies such as GPT-2's 50257)."""
    base, extra = divmod(count, tp)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def column_spec(out_features: int, tp: int, rank: int, what: str = "out_features") -> ShardSpec:
    start, n = even_range(out_features, tp, rank, what)
    return ShardSpec(0, out_features, ((start, n),))


def row_spec(in_features: int, tp: int, rank: int, what: str = "in_features") -> ShardSpec:
    start, n = even_range(in_features, tp, rank, what)
    return ShardSpec(1, in_features, ((start, n),))


def vocab_spec(vocab: int, tp: int, rank: int) -> ShardSpec:
    start, n = balanced_range(vocab, tp, rank)
    return ShardSpec(0, vocab, ((start, n),))


def fused_spec(
    sizes: list[int], tp: int, rank: int, dim: int = 0, unit: int = 1, what: str = "fused weight"
) -> ShardSpec:
    """Rank's slice of each sub-weight of a fused weight whose parts (sizes along `dim`) are stacked;
    Note [fused and head-aware layouts]. `unit` (a head size) is the smallest piece a part splits into."""
    segments, offset = [], 0
    for i, size in enumerate(sizes):
        if size % unit:
            raise ValueError(f"{what}: part {i} has size {size}, not a multiple of the unit {unit}")
        start, n = even_range(size // unit, tp, rank, f"{what} part {i} ({size // unit} units of {unit})")
        segments.append((offset + start * unit, n * unit))
        offset += size
    return ShardSpec(dim, offset, tuple(segments))


def fused_sizes(shape: list, full_size: int) -> list[int]:
    """DeepSpeed's `layer_specs[].shape` for a fused weight, resolved to part sizes along the split
    dimension: [k, -1] is k equal parts; [[a, b, c], -1] parts of sizes a, b, c."""
    if not shape:
        return [full_size]
    head = shape[0]
    if isinstance(head, (list, tuple)):
        sizes = [int(s) for s in head]
    elif isinstance(head, int) and head > 0:
        if full_size % head:
            raise ValueError(f"fused shape {shape}: {full_size} rows do not split into {head} equal parts")
        sizes = [full_size // head] * head
    else:
        raise ValueError(f"fused shape {shape}: the first entry must be a part count or a list of part sizes")
    if sum(sizes) != full_size:
        raise ValueError(f"fused shape {shape}: parts sum to {sum(sizes)}, but the weight has {full_size} rows")
    return sizes


@dataclass(frozen=True)
class HeadLayout:
    """Rank's attention heads: query heads [q_start, q_start + q_heads), kv heads
    [kv_start, kv_start + kv_heads), each kv head held by `kv_replicas` ranks."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    kv_replicas: int

    @property
    def kv_groups(self) -> int:
        """Query heads per local kv head (transformers' `num_key_value_groups`)."""
        return self.q_heads // self.kv_heads


def valid_attention_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    """tp sizes that divide the query heads and either divide the kv heads or are a multiple of them."""
    return [
        p
        for p in valid_tp_sizes(num_heads, limit=min(limit, num_heads))
        if num_kv_heads % p == 0 or p % num_kv_heads == 0
    ]


def head_layout(num_heads: int, num_kv_heads: int, tp: int, rank: int, what: str = "attention") -> HeadLayout:
    """Which heads rank holds; Note [fused and head-aware layouts]."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{what}: {num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if tp not in valid_attention_tp_sizes(num_heads, num_kv_heads, limit=max(tp, 1)):
        raise ValueError(
            f"{what}: {num_heads} query heads and {num_kv_heads} kv heads cannot be split over "
            f"tp={tp} ranks; valid tp sizes: {valid_attention_tp_sizes(num_heads, num_kv_heads)}"
        )
    q = num_heads // tp
    if num_kv_heads % tp == 0:
        kv = num_kv_heads // tp
        return HeadLayout(rank * q, q, rank * kv, kv, 1)
    replicas = tp // num_kv_heads
    return HeadLayout(rank * q, q, rank // replicas, 1, replicas)


def heads_spec(layout: HeadLayout, head_dim: int, num_heads_full: int, kv: bool, dim: int = 0) -> ShardSpec:
    """The rows (dim 0: q/k/v projections) or columns (dim 1: the output projection) of one rank."""
    start, n, reps = (
        (layout.kv_start, layout.kv_heads, layout.kv_replicas) if kv else (layout.q_start, layout.q_heads, 1)
    )
    return ShardSpec(dim, num_heads_full * head_dim, ((start * head_dim, n * head_dim),), reps)
