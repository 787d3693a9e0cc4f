"""What each rank process runs: its argv and its environment (pure functions)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.worker import command_line, zerospeed_variables
from zerospeed.launcher.world import NodeLayout


@dataclass(frozen=True)
class UserCommand:
    """The user's training program and how to start it."""

    script: str  # path, module name (module=True) or executable (no_python=True)
    args: tuple[str, ...] = ()  # passed through verbatim
    module: bool = False  # run as ``python -m script``
    no_python: bool = False  # run ``script`` itself as an executable
    no_local_rank: bool = False  # do not append ``--local_rank=N``

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise LauncherError("--module and --no_python cannot be used together: a module needs python")


def user_argv(command: UserCommand, local_rank: int) -> list[str]:
    """What the rank runs, without the interpreter: ``[script, --local_rank=N, *args]``."""
    local = [] if command.no_local_rank else [f"--local_rank={local_rank}"]
    return [command.script, *local, *command.args]


def run_mode(command: UserCommand) -> str:
    """How ``worker.py`` starts the command: ``script``, ``module`` or ``exec`` (``--no_python``)."""
    return "exec" if command.no_python else "module" if command.module else "script"


def rank_argv(command: UserCommand, local_rank: int, python: str = sys.executable) -> list[str]:
    """argv of the process with ``local_rank``: ``[python, -u, (-m), script, --local_rank=N, *args]``
    (what ``worker.py`` exec's, and ``ps`` shows)."""
    return command_line(run_mode(command), user_argv(command, local_rank), python)


def omp_num_threads(cpu_count: int, local_size: int) -> int:
    """Threads per process so that this node's processes share its cores without oversubscription."""
    return max(1, cpu_count // local_size)


def available_cpus() -> int:
    """CPU cores this process may run on (respects affinity masks and container cpusets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def node_variables(layout: NodeLayout, *, cpu_count: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """What every rank of the node gets from zerospeed besides the agent's variables.

    ``CUDA_VISIBLE_DEVICES`` (this node's slots) and ``OMP_NUM_THREADS`` unless the user set it.
    """
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, layout.slots))}
    # DeepSpeed leaves OMP_NUM_THREADS unset, so every rank's torch starts one thread per core and
    # the ranks of a node fight over the same cores: on a 2-core machine two such ranks make each
    # training step 2.1x slower than with the cores split between them. A user's value wins.
    if "OMP_NUM_THREADS" not in base_env:
        env["OMP_NUM_THREADS"] = str(omp_num_threads(cpu_count, layout.local_size))
    return env


def agent_variables(layout: NodeLayout, local_rank: int, *, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torch's elastic agent sets for a worker of a fixed world (those zerospeed reads)."""
    return {
        "RANK": str(layout.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(layout.local_size),
        "GROUP_RANK": str(layout.node_rank),
        "GROUP_WORLD_SIZE": str(layout.num_nodes),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def rank_environment(
    layout: NodeLayout,
    local_rank: int,
    *,
    master_addr: str,
    master_port: int,
    cpu_count: int,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """The full environment of one rank of a fixed world: ``base_env`` plus the distributed setup.

    ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_SIZE``, ``CROSS_RANK``/``CROSS_SIZE`` (node index
    and count), ``MASTER_ADDR``/``MASTER_PORT``, ``CUDA_VISIBLE_DEVICES`` (this node's slots) and
    ``OMP_NUM_THREADS`` unless the user set it; plus torch's names for the same (``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``GROUP_WORLD_SIZE``). It is what the agent's variables (``agent_variables``),
    zerospeed's names for them (``worker.zerospeed_variables``) and the node's (``node_variables``)
    add up to in ``worker.py``.
    """
    env = dict(base_env)
    env.update(agent_variables(layout, local_rank, master_addr=master_addr, master_port=master_port))
    env.update(zerospeed_variables(env))
    env.update(node_variables(layout, cpu_count=cpu_count, base_env=base_env))
    return env
