"""Pure layout math of Ulysses sequence parallelism: which heads each rank attends, which key/value
heads it needs, and how a sequence is padded and sliced. Integers only; no processes.

Note [uneven heads]: DeepSpeed requires the head count to divide the degree P (or, for key/value heads,
the degree to divide the head count) and errors otherwise. Attention is independent per head, so any
split is exact: rank r takes a contiguous block of query heads, the first `H % P` ranks one more
(`head_split`). A rank needs the key/value heads its query heads read (GQA: query head h reads kv head
h // (H / H_kv)); when P exceeds the kv-head count, or blocks straddle groups, a kv head goes to several
ranks (replication instead of idle ranks). The local attention then sees n_q query and n_kv kv heads with
the uniform GQA mapping local q a -> local kv a // (n_q / n_kv); where a block's mapping is not uniform
(e.g. 6 query heads over 3 kv heads split 2/2/1/1), the rank gets one kv head per query head instead.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def head_split(num_heads: int, world: int) -> list[int]:
    """Query heads per rank: as even as possible, the first `num_heads % world` ranks one more."""
    _check_positive(num_heads=num_heads, world=world)
    if num_heads < world:
        raise ValueError(
            f"{num_heads} attention heads cannot be split over a sequence-parallel degree of {world}: "
            f"every rank needs at least one head; use sequence_parallel_size <= {num_heads}"
        )
    base, extra = divmod(num_heads, world)
    return [base + (r < extra) for r in range(world)]


def head_blocks(num_heads: int, world: int) -> list[list[int]]:
    """The query heads of each rank (contiguous blocks, rank order)."""
    out, start = [], 0
    for n in head_split(num_heads, world):
        out.append(list(range(start, start + n)))
        start += n
    return out


def kv_heads_for(q_heads: list[int], num_heads: int, num_kv_heads: int) -> list[int]:
    """The kv heads a rank holding query heads `q_heads` receives (Note [uneven heads]): the distinct kv
    heads they read when each is read by the same number of consecutive query heads, else one per query head."""
    _check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    group = num_heads // num_kv_heads
    reads = [h // group for h in q_heads]
    distinct = sorted(set(reads))
    per = len(reads) // len(distinct)
    uniform = len(reads) % len(distinct) == 0 and reads == [k for k in distinct for _ in range(per)]
    return distinct if uniform else reads


@dataclass(frozen=True)
class HeadPlan:
    """Which query and kv heads every rank attends (rank order)."""

    q: tuple[tuple[int, ...], ...]
    kv: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, world: int) -> HeadPlan:
        blocks = head_blocks(num_heads, world)
        return cls(tuple(map(tuple, blocks)), tuple(tuple(kv_heads_for(b, num_heads, num_kv_heads)) for b in blocks))

    def kv_groups(self, rank: int) -> int:
        """Local query heads per local kv head on `rank` (what GQA repeats by)."""
        return len(self.q[rank]) // len(self.kv[rank])


def padded_length(seq_len: int, world: int) -> int:
    """The smallest multiple of `world` >= `seq_len`: sequences are padded at the end to it."""
    _check_positive(seq_len=seq_len, world=world)
    return -(-seq_len // world) * world


def shard_range(seq_len: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s slice of a sequence padded to `padded_length(seq_len, world)`."""
    local = padded_length(seq_len, world) // world
    return rank * local, (rank + 1) * local
