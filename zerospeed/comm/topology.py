"""The parallel layout as a pure rank grid.

Ranks are laid out as a C-order array of shape (pp, dp, sp, tp): tensor-parallel ranks are adjacent
(they talk the most), pipeline stages the farthest apart — Megatron's default order (tp fastest, then
context/sequence, then data, then pipeline) and DeepSpeed's `PipeModelDataParallelTopology`
('pipe', 'data', 'model'). The expert axis `ep` splits each sequence-data-parallel group (dp x sp;
just the data-parallel group without sequence parallelism: Note [expert layout]).
Every query is integer arithmetic, so the layout is tested without processes; `comm.mesh` turns it
into process groups.

Note [expert layout]: DeepSpeed (`utils/groups.py`, `_get_expert_parallel_ranks`) splits every
data-parallel group, taken in rank order, into consecutive blocks of `ep` ranks: each block is an
expert-parallel group (the experts are sharded over it; tokens travel all-to-all inside it), and the
ranks holding the same position in every block form an expert-data-parallel group (an expert's
replicas; its gradients are reduced over it). So a data-parallel index d is (edp, ep) with
d = edp * ep_size + ep. World 8, ep 2 -> expert-parallel [0,1] [2,3] [4,5] [6,7], expert-data-parallel
[0,2,4,6] [1,3,5,7]. Dense weights still reduce over the whole data-parallel group.

With sequence parallelism (sp > 1) the groups split are the sequence-data-parallel ones (dp x sp,
`dp_sp`), the groups dense weights reduce over: an expert then sees the tokens of its expert-parallel
ranks' sequence slices, and its gradient is averaged over its replicas exactly as a dense weight's is
over dp x sp (Note [sequence-parallel loss]: every sequence rank's gradient is a full contribution to
its replica's mean, so averaging over dp x sp gives the mean over replicas). The index split is then
i = edp * ep_size + ep with i = d * sp + s. Without sequence parallelism nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

AXES = ("pp", "dp", "sp", "tp")
"""The grid's own axes, slowest to fastest."""
DERIVED_AXES = ("ep", "edp", "dp_sp", "mp", "world")
"""Axes made from the grid's: expert / expert-data parallel (split dp x sp), sequence-data parallel
(dp x sp), model parallel (= tp, Megatron's get_model_parallel_group), the whole world."""
MESH_AXES = AXES + DERIVED_AXES


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _size_problem(axis: str, value) -> str:
    name = "world size" if axis == "world" else f"{axis} size"
    fix = "a job has at least one rank" if axis == "world" else f"use 1 to leave the {axis} axis unsplit"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an integer, got {value!r}: pass a whole number such as 1 or 2"
    return f"{name} must be >= 1, got {value}: {fix}"


def layout_problems(*, world_size: int | None = None, pp=1, dp=None, sp=1, tp=1, ep=1) -> list[str]:
    """Every violated constraint of a layout, each with its fix (empty when the layout is valid).

    `dp=None` means "data parallelism fills the rest of `world_size`".
    """
    sizes = {"world": world_size, "pp": pp, "dp": dp, "sp": sp, "tp": tp, "ep": ep}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    problems = [_size_problem(k, v) for k, v in sizes.items() if not _is_size(v)]
    if all(_is_size(v) for k, v in sizes.items() if k != "ep"):
        problems += _world_problems(world_size, pp, dp, sp, tp)
        if dp is None and not problems and world_size is not None:
            dp = world_size // (pp * sp * tp)
    if dp is not None and _is_size(dp) and _is_size(ep) and _is_size(sp) and (dp * sp) % ep:
        what, group = (
            ("data-parallel size dp", "data-parallel")
            if sp == 1
            else (f"sequence-data-parallel size dp x sp = {dp}*{sp}", "sequence-data-parallel")
        )
        problems.append(
            f"ep={ep} does not divide the {what}={dp * sp}: expert-parallel groups "
            f"split each {group} group, so choose ep among {_divisors(dp * sp)}"
        )
    return problems


def _world_problems(world_size, pp, dp, sp, tp) -> list[str]:
    if world_size is None:
        return []
    if dp is not None and pp * dp * sp * tp != world_size:
        return [
            f"pp*dp*sp*tp = {pp}*{dp}*{sp}*{tp} = {pp * dp * sp * tp} ranks but the world has {world_size}: "
            "leave dp out to let data parallelism fill the rest"
        ]
    other = pp * sp * tp
    if dp is None and world_size % other:
        return [
            f"world size {world_size} is not divisible by pp*sp*tp = {pp}*{sp}*{tp} = {other}: run on a "
            f"multiple of {other} ranks, or choose pp*sp*tp among the divisors of {world_size}: "
            f"{_divisors(world_size)}"
        ]
    return []


def validate_layout(**sizes) -> None:
    """Raise one ValueError listing every problem `layout_problems(**sizes)` finds."""
    raise_problems(layout_problems(**sizes))


def raise_problems(problems: list[str]) -> None:
    """One ValueError for all `problems` (a single one is the message itself)."""
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(
            f"the parallel layout has {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def expert_layout(dp_groups: list[list[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of each data-parallel group, in order.

    See Note [expert layout]; `ep` must divide every group's size.
    """
    ep_groups, edp_groups = [], []
    for ranks in dp_groups:
        if len(ranks) % ep:
            raise ValueError(f"ep={ep} does not divide the data-parallel group {ranks} (size {len(ranks)})")
        ranks = sorted(ranks)
        ep_groups += [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
        edp_groups += [ranks[i::ep] for i in range(ep)]
    return ep_groups, edp_groups


@dataclass(frozen=True)
class RankGrid:
    """A (pp, dp, sp, tp) rank layout, with `ep` expert-parallel ranks inside each data-parallel group."""

    pp: int = 1
    dp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        validate_layout(pp=self.pp, dp=self.dp, sp=self.sp, tp=self.tp, ep=self.ep)

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, sp: int = 1, tp: int = 1, ep: int = 1) -> RankGrid:
        """The grid whose data-parallel size fills the rest of `world_size`."""
        validate_layout(world_size=world_size, pp=pp, sp=sp, tp=tp, ep=ep)
        return cls(pp=pp, dp=world_size // (pp * sp * tp), sp=sp, tp=tp, ep=ep)

    def with_ep(self, ep: int) -> RankGrid:
        """The same grid with another expert-parallel size."""
        return replace(self, ep=ep)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.sp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along each grid axis (pp, dp, sp, tp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            out[axis] = rank % size
            rank //= size
        return {axis: out[axis] for axis in AXES}

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index in its expert-parallel ("ep") and expert-data-parallel ("edp") groups."""
        c = self.coords(rank)
        i = c["dp"] * self.sp + c["sp"]  # its index in its sequence-data-parallel group (Note [expert layout])
        return {"ep": i % self.ep, "edp": i // self.ep}

    def rank(self, **coords: int) -> int:
        """Coordinates (missing axes = 0) -> rank."""
        rank = 0
        for axis, size in zip(AXES, self.shape):
            rank = rank * size + coords.get(axis, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ranks along `axis` (e.g. the data-parallel groups); each group is ascending.

        `axis` is a grid axis (pp, dp, sp, tp) or a derived one (ep, edp, dp_sp, mp, world).
        """
        if axis in AXES:
            return self._span((axis,))
        if axis in ("ep", "edp"):
            return expert_layout(self._span(("dp", "sp")), self.ep)[axis == "edp"]
        if axis == "dp_sp":
            return self._span(("dp", "sp"))
        if axis == "mp":
            return self._span(("tp",))
        if axis == "world":
            return [list(range(self.world_size))]
        raise ValueError(f"unknown axis {axis!r}; expected one of {MESH_AXES}")

    def _span(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that differ only along the `varying` axes, one per setting of the others."""
        sizes = dict(zip(AXES, self.shape))
        fixed_axes = [a for a in AXES if a not in varying]
        groups = []
        for fixed in product(*(range(sizes[a]) for a in fixed_axes)):
            base = dict(zip(fixed_axes, fixed))
            groups.append(
                sorted(
                    self.rank(**base, **dict(zip(varying, idx))) for idx in product(*(range(sizes[a]) for a in varying))
                )
            )
        return groups

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The group along `axis` that contains `rank`."""
        return next(g for g in self.groups(axis) if rank in g)
