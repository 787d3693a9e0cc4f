"""Megatron/DeepSpeed `mpu` objects and the mesh: `MeshMpu` offers a ParallelMesh as an mpu, and
`mesh_axes_from_mpu` reads an mpu's groups into mesh axes (for `ParallelMesh.from_mpu`)."""

from __future__ import annotations

from zerospeed.comm.axis_groups import AxisGroup, GroupMaker

MPU_AXES = {
    "data": "dp",
    "model": "mp",
    "tensor_model": "tp",
    "pipeline_model": "pp",
    "pipe": "pp",
    "sequence": "sp",
    "sequence_data": "dp_sp",
}
"""The kind in mpu.get_<kind>_parallel_group() -> the mesh axis it names."""

# Which mpu methods give each axis, the first one present winning: a Megatron mpu calls tensor
# parallelism "tensor_model"; DeepSpeed's examples call it "model".
_READ_ORDER = {
    "dp": ("data",),
    "tp": ("tensor_model", "model"),
    "mp": ("model", "tensor_model"),
    "pp": ("pipeline_model", "pipe"),
    "sp": ("sequence",),
    "dp_sp": ("sequence_data",),
}


def expert_size(name: int | str) -> int:
    """The expert-parallel size in DeepSpeed's expert group name "ep_size_N" (an int passes through)."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if isinstance(name, str) and name.startswith("ep_size_") and name[len("ep_size_") :].isdigit():
        return int(name[len("ep_size_") :])
    raise ValueError(f"expert group name {name!r} is not DeepSpeed's 'ep_size_<N>' (e.g. 'ep_size_2')")


def _claim(mpu, method: str, default: int) -> int:
    found = getattr(mpu, method, None)
    return found() if callable(found) else default


def _read_group(mpu, kind: str) -> AxisGroup | None:
    get = getattr(mpu, f"get_{kind}_parallel_group", None)
    if not callable(get):
        return None
    seen = AxisGroup.of(get())
    claims = [
        _claim(mpu, f"get_{kind}_parallel_world_size", seen.size),
        _claim(mpu, f"get_{kind}_parallel_rank", seen.rank),
    ]
    if claims != [seen.size, seen.rank]:
        raise ValueError(
            f"mpu.get_{kind}_parallel_world_size()/rank() say {claims[0]}/{claims[1]} but its "
            f"group has {seen.size} ranks with this rank at {seen.rank}; make them agree"
        )
    return seen


def mesh_axes_from_mpu(mpu, maker: GroupMaker) -> dict[str, AxisGroup | None]:
    """The mesh axes an mpu describes; axes it lacks have size 1 (dp_sp: unknown if sp > 1)."""
    axes = {axis: next(filter(None, (_read_group(mpu, k) for k in kinds)), None) for axis, kinds in _READ_ORDER.items()}
    if axes["dp"] is None:
        raise TypeError(
            f"{type(mpu).__name__} is not an mpu: it has no get_data_parallel_group(); give an "
            "object with Megatron's get_*_parallel_group() methods, or use ParallelMesh.build()"
        )
    one = maker.singletons()  # comm.SELF (Note [size-1 axes])
    axes.update({axis: axes[axis] or one for axis in ("pp", "sp", "tp", "mp")})
    if axes["dp_sp"] is None and axes["sp"].size == 1:
        axes["dp_sp"] = axes["dp"]
    axes.update(ep=one, edp=axes["dp"], world=maker.axis([list(range(maker.world))]))
    return axes


class MeshMpu:
    """A ParallelMesh as a Megatron/DeepSpeed `mpu`.

    get_<kind>_parallel_group() / _world_size() / _rank() for every kind in `MPU_AXES` (data, model,
    tensor_model, pipeline_model, pipe, sequence, sequence_data), and the expert groups by DeepSpeed's
    names: get_expert_parallel_group("ep_size_2"), get_expert_data_parallel_group("ep_size_2"), ...
    """

    def __init__(self, mesh):
        self.mesh = mesh

    def get_global_rank(self) -> int:
        return self.mesh.rank

    def get_expert_parallel_group(self, name: int | str):
        return self.mesh.expert_parallel_group(expert_size(name))

    def get_expert_parallel_world_size(self, name: int | str) -> int:
        return self.mesh.expert_axes(expert_size(name))[0].size

    def get_expert_parallel_rank(self, name: int | str) -> int:
        return self.mesh.expert_axes(expert_size(name))[0].rank

    def get_expert_data_parallel_group(self, name: int | str):
        return self.mesh.expert_data_parallel_group(expert_size(name))

    def get_expert_data_parallel_world_size(self, name: int | str) -> int:
        return self.mesh.expert_axes(expert_size(name))[1].size

    def get_expert_data_parallel_rank(self, name: int | str) -> int:
        return self.mesh.expert_axes(expert_size(name))[1].rank


def _axis_methods(kind: str, axis: str) -> dict:
    def group(self):
        return self.mesh.group(axis)

    def world_size(self) -> int:
        return self.mesh.size(axis)

    def rank(self) -> int:
        return self.mesh.rank_in(axis)

    return {"group": group, "world_size": world_size, "rank": rank}


def _install_axis_methods() -> None:
    for kind, axis in MPU_AXES.items():
        for what, method in _axis_methods(kind, axis).items():
            method.__name__ = method.__qualname__ = f"get_{kind}_parallel_{what}"
            method.__doc__ = f"This rank's {axis!r} {'process group' if what == 'group' else what.replace('_', ' ')}."
            setattr(MeshMpu, method.__name__, method)


_install_axis_methods()
