"""The world layout: which global ranks live on which node, and its wire encoding.

A *world* is an ordered ``{host: [slot, ...]}``. Global ranks are numbered node by node in that
order, and within a node in slot order; a rank's local rank is its index within its node.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerospeed.launcher.errors import LauncherError


@dataclass(frozen=True)
class NodeLayout:
    """Where one node sits in the world, and what its processes are."""

    node_rank: int  # index of this node in the world (CROSS_RANK)
    num_nodes: int  # CROSS_SIZE
    world_size: int  # total processes over all nodes
    first_rank: int  # global rank of this node's local rank 0
    slots: tuple[int, ...]  # device ids this node's processes use, in local-rank order

    @property
    def local_size(self) -> int:
        """Number of processes on this node."""
        return len(self.slots)

    def global_rank(self, local_rank: int) -> int:
        """Global rank of this node's ``local_rank``."""
        return self.first_rank + local_rank


def node_layout(world: Mapping[str, Sequence[int]], node_rank: int) -> NodeLayout:
    """Layout of node ``node_rank`` in ``world``."""
    hosts = list(world)
    if not 0 <= node_rank < len(hosts):
        raise LauncherError(
            f"node rank {node_rank} is outside 0..{len(hosts) - 1} "
            f"(the world has {len(hosts)} node(s): {', '.join(hosts)})"
        )
    first = sum(len(world[h]) for h in hosts[:node_rank])
    return NodeLayout(
        node_rank=node_rank,
        num_nodes=len(hosts),
        world_size=sum(len(s) for s in world.values()),
        first_rank=first,
        slots=tuple(world[hosts[node_rank]]),
    )


def uniform_world(num_nodes: int, slots: Sequence[int]) -> dict[str, list[int]]:
    """A world of ``num_nodes`` identical nodes, for launches without a hostfile (torchrun style).

    The host names are placeholders: each node's launcher only needs its own position.
    """
    return {f"node-{i}": list(slots) for i in range(num_nodes)}


def encode_world_info(world: Mapping[str, Sequence[int]]) -> str:
    """URL-safe base64 of the world's JSON, safe to pass on any command line or remote shell."""
    data = json.dumps({h: list(s) for h, s in world.items()}).encode()
    return base64.urlsafe_b64encode(data).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    """Inverse of ``encode_world_info``; a malformed value raises ``LauncherError``."""
    try:
        world = json.loads(base64.urlsafe_b64decode(text.encode()))
    except ValueError as err:
        raise LauncherError(f"--world_info is not base64-encoded JSON: {err}") from None
    valid = (
        isinstance(world, dict)
        and world
        and all(isinstance(s, list) and s and all(isinstance(x, int) for x in s) for s in world.values())
    )
    if not valid:
        raise LauncherError(f"--world_info must encode a non-empty {{host: [slot, ...]}}, got {world!r}")
    return world
