"""`ParallelMesh`: how the world is split, and every process group of that split, in one object.

A mesh is built once (collectively: every rank calls the constructor, in the same order) and passed
down explicitly; nothing about it lives in module globals. Axes (see `comm.topology`):

    pp     pipeline stages               dp     data parallel (dense weights reduce over it)
    sp     sequence parallel (Ulysses)   tp     tensor parallel (adjacent ranks)
    ep     expert parallel (splits dp)   edp    expert data parallel (an expert's replicas)
    dp_sp  sequence-data parallel (dp x sp; weights of a sequence-parallel model reduce over it)
    mp     model parallel (Megatron's get_model_parallel_group: tp in a built mesh)
    world  every rank

`group(axis)` is the process-group handle (None = the world group), `size(axis)` / `rank_in(axis)`
this rank's view, `members(axis)` the global ranks. Expert groups for other expert-parallel sizes
(DeepSpeed's param groups named "ep_size_N") come from `expert_parallel_group(N)` /
`expert_data_parallel_group(N)`; `as_mpu()` offers the whole mesh to code written for a
Megatron/DeepSpeed `mpu`, and `from_mpu(mpu)` wraps such an object.

Note [size-1 axes]: an axis whose groups are single ranks gets `comm.SELF`, the group of this rank
alone: `comm.get_rank(SELF)` is 0, `get_world_size(SELF)` 1, and every collective on it is the
identity, so no torch process group is made. (None cannot stand for it — None is the world group —
and a real one-rank group is a collective `new_group` per rank: W of them for every plain
data-parallel engine.) Groups of two or more ranks are made once per mesh (`GroupMaker` reuses a
group already made for the same ranks), every rank asking for every group in the same order.
"""

from __future__ import annotations

from zerospeed.comm import backend
from zerospeed.comm.axis_groups import AxisGroup, GroupMaker
from zerospeed.comm.mpu import MeshMpu, mesh_axes_from_mpu
from zerospeed.comm.topology import MESH_AXES, RankGrid, expert_layout, layout_problems, raise_problems
from zerospeed.utils.errors import ConfigError


class ParallelMesh:
    """The parallel layout of the job and this rank's process group along each axis (module docstring)."""

    def __init__(
        self, axes: dict[str, AxisGroup | None], *, grid: RankGrid | None = None, maker: GroupMaker | None = None
    ):
        self.rank, self.world_size = backend.get_rank(), backend.get_world_size()
        self.grid = grid
        """The RankGrid, or None when the mesh wraps groups made elsewhere (`from_mpu`)."""
        self._axes = axes
        self._maker = maker or GroupMaker(self.rank, self.world_size)
        self._experts: dict[int, tuple[AxisGroup, AxisGroup]] = {axes["ep"].size: (axes["ep"], axes["edp"])}
        self._mics: dict[int, tuple[AxisGroup, AxisGroup]] = {}
        self._mpu = None  # the mpu this mesh wraps (from_mpu), handed back by as_mpu

    # -- constructors (collective) -----------------------------------------------------------------
    @classmethod
    def build(
        cls, *, pp: int = 1, tp: int = 1, sp: int = 1, ep: int = 1, world_size: int | None = None
    ) -> ParallelMesh:
        """The mesh with these sizes; data parallelism fills the rest of the world.

        `world_size`, when given, must be the job's (a check for scripts that assume one).
        Every rank must call this together.
        """
        world = backend.get_world_size()
        problems = layout_problems(world_size=world, pp=pp, sp=sp, tp=tp, ep=ep)
        if world_size is not None and world_size != world:
            problems.insert(
                0,
                f"world_size={world_size} but the job has {world} ranks: launch "
                f"{world_size} processes or leave world_size out",
            )
        raise_problems(problems)
        return cls.from_grid(RankGrid.for_world(world, pp=pp, sp=sp, tp=tp, ep=ep))

    @classmethod
    def from_grid(cls, grid: RankGrid) -> ParallelMesh:
        """The mesh of `grid`, making every group of every axis once (every rank must call this)."""
        rank, world = backend.get_rank(), backend.get_world_size()
        if grid.world_size != world:
            raise ValueError(f"rank grid {grid.shape} has {grid.world_size} ranks but the job has {world}")
        maker = GroupMaker(rank, world)
        return cls({axis: maker.axis(grid.groups(axis)) for axis in MESH_AXES}, grid=grid, maker=maker)

    @classmethod
    def data_parallel(cls, group=None) -> ParallelMesh:
        """Plain data parallelism over `group` (None = the world); every other axis has size 1."""
        if group is None:
            return cls.from_grid(RankGrid(dp=backend.get_world_size()))
        maker = GroupMaker(backend.get_rank(), backend.get_world_size())
        dp, one = AxisGroup.of(group), maker.singletons()
        return cls(
            {
                "pp": one,
                "dp": dp,
                "sp": one,
                "tp": one,
                "ep": one,
                "edp": dp,
                "dp_sp": dp,
                "mp": one,
                "world": maker.axis([list(range(maker.world))]),
            },
            maker=maker,
        )

    @classmethod
    def from_mpu(cls, mpu) -> ParallelMesh:
        """Wrap a Megatron/DeepSpeed-style `mpu` (its groups are used as they are; `grid` is None)."""
        maker = GroupMaker(backend.get_rank(), backend.get_world_size())
        mesh = cls(mesh_axes_from_mpu(mpu, maker), maker=maker)
        mesh._mpu = mpu
        return mesh

    # -- queries -------------------------------------------------------------------------------------
    def _axis(self, axis: str) -> AxisGroup:
        if axis not in MESH_AXES:
            raise ValueError(f"unknown parallel axis {axis!r}; expected one of {MESH_AXES}")
        found = self._axes.get(axis)
        if found is None:
            raise ValueError(
                f"this mesh does not know its {axis!r} group: the mpu it wraps has no "
                "get_sequence_data_parallel_group(); add that method to the mpu, or build the "
                "mesh with ParallelMesh.build(sp=...)"
            )
        return found

    def group(self, axis: str):
        """The process group of this rank along `axis` (None means the world group)."""
        return self._axis(axis).handle

    def size(self, axis: str) -> int:
        """The number of ranks in this rank's `axis` group."""
        return self._axis(axis).size

    def rank_in(self, axis: str) -> int:
        """This rank's index in its `axis` group (its group rank)."""
        return self._axis(axis).rank

    def members(self, axis: str) -> list[int]:
        """The global ranks of this rank's `axis` group, in group-rank order."""
        return list(self._axis(axis).members)

    @property
    def coords(self) -> dict[str, int] | None:
        """This rank's index along pp, dp, sp, tp, ep, edp; None when the grid is unknown."""
        if self.grid is None:
            return None
        return {**self.grid.coords(self.rank), **self.grid.expert_coords(self.rank)}

    # -- expert groups -------------------------------------------------------------------------------
    def expert_parallel_group(self, ep_size: int):
        """The expert-parallel group of size `ep_size` holding this rank (DeepSpeed's "ep_size_N")."""
        return self.expert_axes(ep_size)[0].handle

    def expert_data_parallel_group(self, ep_size: int):
        """The group over which this rank's experts of an `ep_size` split are replicated."""
        return self.expert_axes(ep_size)[1].handle

    def expert_axes(self, ep_size: int) -> tuple[AxisGroup, AxisGroup]:
        """(expert-parallel, expert-data-parallel) groups for `ep_size`; Note [expert layout].

        A size the mesh was not built with is made on first request. That is collective: every rank
        must ask for the same sizes in the same order (DeepSpeed's MoE layers do, being built on every
        rank); a rank asking for another size gets an error instead of a hang.
        """
        if ep_size not in self._experts:
            raise_problems(layout_problems(dp=self.size("dp"), sp=self.size("sp"), ep=ep_size))
            ep_groups, edp_groups = expert_layout(self._all_dp_groups(ep_size), ep_size)
            self._experts[ep_size] = (self._maker.axis(ep_groups), self._maker.axis(edp_groups))
        return self._experts[ep_size]

    def mics_axes(self, shard_size: int) -> tuple[AxisGroup, AxisGroup]:
        """(shard, replica) groups of MiCS (`zero_optimization.mics_shard_size`; Note [MiCS] in
        zero/strategy.py): this rank's data-parallel group cut into consecutive groups of `shard_size`
        ranks, which partition the states, and the ranks holding the same partition in the other shard
        groups, over which gradients are all-reduced. Made on first request (collective, like
        `expert_axes`)."""
        if shard_size not in self._mics:
            dp = self.size("dp_sp")
            if shard_size > dp or dp % shard_size:
                raise ConfigError(
                    f"zero_optimization.mics_shard_size={shard_size} must divide the data-parallel "
                    f"size {dp} (the ranks of a shard group partition the model; choose a divisor "
                    "of it, usually the GPUs per node)"
                )
            groups = self._all_dp_groups(shard_size)
            shards = [g[i : i + shard_size] for g in groups for i in range(0, len(g), shard_size)]
            replicas = [g[j::shard_size] for g in groups for j in range(shard_size)]
            self._mics[shard_size] = (self._maker.axis(shards), self._maker.axis(replicas))
        return self._mics[shard_size]

    def _all_dp_groups(self, ep_size: int) -> list[list[int]]:
        """Every rank's sequence-data-parallel group (its data-parallel group without sequence parallelism;
        Note [expert layout]), learnt from the ranks themselves (one all-gather)."""
        asked = backend.all_gather_object((ep_size, self.members("dp_sp")))
        if len({size for size, _ in asked}) > 1:
            raise ValueError(
                f"ranks asked for expert groups of different sizes at the same point: "
                f"{[size for size, _ in asked]} (by rank); every rank must request the same "
                "ep sizes in the same order"
            )
        groups = sorted({tuple(members) for _, members in asked})
        if sorted(r for g in groups for r in g) != list(range(self.world_size)):
            raise ValueError(f"the data-parallel groups {groups} do not partition the {self.world_size} ranks")
        return [list(g) for g in groups]

    def as_mpu(self):
        """This mesh as a Megatron/DeepSpeed `mpu` (get_data_parallel_group(), ...): the mpu it was
        made from, if any (DeepSpeed's `engine.mpu` is the user's own); otherwise an adapter whose
        size-1 groups are `comm.SELF` (Note [size-1 axes]) — fine for zerospeed.comm's collectives
        and `*_world_size()` / `*_rank()`, not a torch.distributed process group."""
        if self._mpu is not None:
            return self._mpu
        return MeshMpu(self)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self._axes[a].size}" for a in ("pp", "dp", "sp", "tp", "ep") if self._axes.get(a))
        return f"ParallelMesh(rank={self.rank}, world={self.world_size}, {sizes})"
