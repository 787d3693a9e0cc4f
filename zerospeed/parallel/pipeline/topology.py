"""DeepSpeed's process topologies (`deepspeed.runtime.pipe.topology`): ranks as a named-axis array.

Pure views, kept for code written against DeepSpeed's names; `to_grid()` gives the equivalent
`comm.RankGrid` (pipe -> pp, data -> dp, model -> tp), which is what zerospeed itself uses.
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product

from zerospeed.comm.topology import RankGrid

_GRID_AXIS = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """Ranks laid out row-major over named axes: the last axis varies fastest.

    `ProcessTopology(axes=["x", "y"], dims=[2, 3])` puts (x, y) and (x, y + 1) on adjacent ranks.
    Coordinates are `ProcessCoord` namedtuples with one field per axis.
    """

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"topology axes {axes} and dims {dims} must pair up, one dim per distinct axis")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"topology dims {dims} must be integers >= 1")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self._coords = [self.ProcessCoord(*c) for c in product(*(range(d) for d in dims))]
        self.mapping = {coord: rank for rank, coord in enumerate(self._coords)}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full set of coordinates, e.g. `get_rank(pipe=1, data=0, model=1)`."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(
                f"get_rank() needs exactly the axes {self.axes}, got {sorted(coord_kwargs)}; "
                "it does not support slices, use filter_match()"
            )
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(
                f"coordinates {dict(coord_kwargs)} are outside the topology {dict(zip(self.axes, self.dims))}"
            )
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        """The axis names, slowest-varying first."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """`rank`'s coordinates as a string such as 'model_01' (DeepSpeed's checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in set(omit_axes)
        )

    def get_dim(self, axis: str) -> int:
        """The number of ranks along `axis` (0 if the topology has no such axis, as in DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        """The `ProcessCoord` of `rank`."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along `axis` ([] if there is no such axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in product(*(range(self.get_dim(a)) for a in others)):
            base = dict(zip(others, fixed))
            lists.append([self.mapping[self.ProcessCoord(**base, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value, e.g. `filter_match(pipe=0, data=1)`."""
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate along `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self._coords)

    def to_grid(self) -> RankGrid:
        """The equivalent RankGrid (pipe -> pp, data -> dp, model -> tp)."""
        split = [a for a in self.axes if self.get_dim(a) > 1]
        if any(a not in _GRID_AXIS for a in self.axes) or split != [a for a in _GRID_AXIS if a in split]:
            raise ValueError(
                f"topology axes {self.axes} (dims {self.dims}) have no RankGrid equivalent: a RankGrid "
                "has the axes 'pipe', 'data', 'model', slowest first; use PipeModelDataParallelTopology"
            )
        return RankGrid(**{_GRID_AXIS[a]: self.get_dim(a) for a in self.axes})

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ('pipe', 'data'), data-parallel ranks adjacent."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: axes ('pipe', 'data', 'model'), model ranks adjacent."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
