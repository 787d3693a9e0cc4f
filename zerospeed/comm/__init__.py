"""zerospeed.comm: the only package that talks to torch.distributed."""
from zerospeed.comm.backend import (DEFAULT_TIMEOUT, SELF, STATS, Handle, backend_availability, all_gather_into_tensor, all_gather_object,
                                    all_to_all_single,
                                    all_reduce, barrier, broadcast, broadcast_object, destroy,
                                    get_local_rank, get_rank, global_rank, get_world_size, init_distributed,
                                    is_initialized, new_group, reduce_scatter_tensor)
from zerospeed.comm.groups import ParallelGroups
from zerospeed.comm.mesh import AxisGroup, ParallelMesh
from zerospeed.comm.mpu import MeshMpu
from zerospeed.comm.p2p import batch_isend_irecv, irecv, isend, recv, send
from zerospeed.comm.stats import CommStats, wire_fraction
from zerospeed.comm.topology import MESH_AXES, RankGrid, layout_problems, validate_layout

__all__ = [
    "DEFAULT_TIMEOUT", "SELF", "STATS", "Handle", "backend_availability", "AxisGroup", "CommStats", "MESH_AXES", "MeshMpu",
    "ParallelGroups", "ParallelMesh", "RankGrid", "layout_problems", "validate_layout", "all_gather_into_tensor", "all_gather_object", "all_to_all_single",
    "all_reduce", "barrier", "broadcast", "broadcast_object", "destroy", "get_local_rank",
    "get_rank", "get_world_size", "global_rank", "init_distributed", "is_initialized", "new_group", "reduce_scatter_tensor", "wire_fraction", "send", "recv", "isend", "irecv", "batch_isend_irecv",
]
