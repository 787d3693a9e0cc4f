"""Pure bucket assignment: which tensors travel together in one collective."""
from __future__ import annotations


def assign_buckets(numels: list[int], bucket_size: int) -> list[list[int]]:
    """Group tensor indices, in the given order, into buckets of at most `bucket_size` elements.

    A tensor larger than `bucket_size` gets a bucket of its own; no tensor is split. The order is
    kept so every rank, given the same list, forms the same buckets and issues collectives in the
    same sequence.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > bucket_size:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
