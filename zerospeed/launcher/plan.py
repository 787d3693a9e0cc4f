"""Turning the command-line flags into a launch plan: the world, and where to run what (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.resources import filter_resources, limit_resources, local_slots
from zerospeed.launcher.runners import LAUNCHERS
from zerospeed.launcher.world import uniform_world

LOCAL_MASTER_ADDR = "127.0.0.1"


class LaunchFlags(Protocol):
    """The flags ``make_plan`` reads (an ``argparse.Namespace`` from ``cli``)."""

    include: str
    exclude: str
    num_nodes: int | None
    num_gpus: int | None
    node_rank: int | None
    master_addr: str
    launcher: str
    no_ssh: bool
    force_multi: bool


@dataclass(frozen=True)
class LaunchPlan:
    """What to launch."""

    world: dict[str, list[int]]  # every node of the job and its slots, in rank order
    node_rank: int | None  # start only this node's ranks, here; None: use the runner
    master_addr: str
    launcher: str  # the multi-node runner (used when node_rank is None)


def make_plan(
    flags: LaunchFlags, hostfile: dict[str, int] | None, visible_devices: str, device_count: Callable[[], int]
) -> LaunchPlan:
    """Resolve flags, hostfile contents and local devices into a ``LaunchPlan``.

    ``device_count`` is called only when nothing else says how many processes to start.
    """
    launcher = flags.launcher.lower()
    if launcher not in LAUNCHERS:
        raise LauncherError(f"--launcher {flags.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if (flags.num_nodes is not None or flags.num_gpus is not None) and (flags.include or flags.exclude):
        raise LauncherError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; "
            "select hosts and slots with one or the other"
        )
    if hostfile is None:
        return _plan_without_hostfile(flags, launcher, visible_devices, device_count)
    return _plan_with_hostfile(flags, launcher, hostfile)


def _plan_without_hostfile(
    flags: LaunchFlags, launcher: str, visible: str, device_count: Callable[[], int]
) -> LaunchPlan:
    slots = local_slots(flags.num_gpus, visible, device_count)
    slots = filter_resources({"localhost": slots}, flags.include, flags.exclude)["localhost"]
    num_nodes = flags.num_nodes or 1
    if num_nodes == 1:
        if flags.node_rank not in (None, 0):
            raise LauncherError(f"--node_rank {flags.node_rank} needs --num_nodes > 1 (or a hostfile)")
        node_rank = None if flags.force_multi else 0
        return LaunchPlan({"localhost": slots}, node_rank, flags.master_addr or LOCAL_MASTER_ADDR, launcher)
    # torchrun style: this invocation is one of num_nodes identical nodes, started separately.
    if flags.node_rank is None or not flags.master_addr:
        raise LauncherError(
            f"--num_nodes {num_nodes} without a hostfile starts one node per invocation: "
            "run it on every node with --node_rank (0..N-1) and --master_addr of node 0, "
            "or give a --hostfile"
        )
    world = uniform_world(num_nodes, slots)
    _check_node_rank(flags.node_rank, world)
    return LaunchPlan(world, flags.node_rank, flags.master_addr, launcher)


def _plan_with_hostfile(flags: LaunchFlags, launcher: str, hostfile: dict[str, int]) -> LaunchPlan:
    world = filter_resources(hostfile, flags.include, flags.exclude)
    world = limit_resources(world, flags.num_nodes, flags.num_gpus)
    first_host = next(iter(world))
    if flags.no_ssh or flags.node_rank is not None:
        # Each node runs `zerospeed ... --node_rank R` itself (DeepSpeed's --no_ssh).
        if flags.node_rank is None:
            raise LauncherError("--no_ssh starts one node per invocation: add --node_rank (0..N-1)")
        _check_node_rank(flags.node_rank, world)
        return LaunchPlan(world, flags.node_rank, flags.master_addr or first_host, launcher)
    if len(world) == 1 and not flags.force_multi:
        return LaunchPlan(world, 0, flags.master_addr or LOCAL_MASTER_ADDR, launcher)
    # The first host runs rank 0; the name reaches it from here, so it reaches it from the nodes.
    default_addr = LOCAL_MASTER_ADDR if launcher == "local" else first_host
    return LaunchPlan(world, None, flags.master_addr or default_addr, launcher)


def _check_node_rank(node_rank: int, world: dict[str, list[int]]) -> None:
    if not 0 <= node_rank < len(world):
        raise LauncherError(f"--node_rank {node_rank} is outside 0..{len(world) - 1} for a job of {len(world)} node(s)")
