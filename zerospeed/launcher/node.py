"""The per-node launcher: runs the rank processes of one node through torch's elastic agent.

Multi-node runners (pdsh, ssh, mpirun, srun, local) start one of these per node as
``python -m zerospeed.launcher.node --world_info=... --node_rank=N ... -- script args``; the
single-node path of ``zerospeed`` calls ``run_node`` in its own process. ``agent.py`` runs the agent,
``worker.py`` is the first code of each rank (it then exec's the user's command).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerospeed.launcher.agent import AgentJob, run_agent
from zerospeed.launcher.cores import cores_for_rank, parse_core_list, physical_cores
from zerospeed.launcher.environment import UserCommand, available_cpus, node_variables, run_mode, user_argv
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.pidfile import saved_pid
from zerospeed.launcher.rendezvous import elastic_nodes, rendezvous_plan
from zerospeed.launcher.world import decode_world_info, node_layout

logger = logging.getLogger(__name__)

# Variables through which MPI implementations and Slurm tell a process its index when a runner
# starts one node launcher per node (Open MPI, MPICH/Intel MPI/MVAPICH hydra, PMIx, MVAPICH, Slurm).
NODE_RANK_ENV_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


@dataclass(frozen=True)
class NodeOptions:
    """Settings shared by every rank of the node."""

    master_addr: str
    master_port: int
    each_rank_log: str | None = None  # directory for one ``<time>_rank<N>.log`` per rank
    save_pid: int | None = None  # main pid naming the ``--save_pid`` file
    watch_stdin: bool = False  # stop when stdin closes (the ssh runner's launcher is gone)
    bind_cores_to_rank: bool = False  # give each local rank its own block of cores (launcher/cores.py)
    bind_core_list: str | None = None  # the cores to split ("0,2-4,6"); default: every physical core
    max_restarts: int = 0  # restarts of the node's ranks after a failure (torch's agent)
    elastic_training: bool = False  # membership may change between min and max elastic nodes
    min_elastic_nodes: int | None = None  # default 1 (DeepSpeed's)
    max_elastic_nodes: int | None = None  # default: the world's node count (DeepSpeed's)


def worker_spec(
    world: Mapping[str, Sequence[int]],
    node_rank: int,
    command: UserCommand,
    options: NodeOptions,
    *,
    base_env: Mapping[str, str],
    cpu_count: int,
    log_prefix: str = "",
) -> dict[str, Any]:
    """What ``worker.py`` needs to turn each of the agent's workers into its rank (pure)."""
    layout = node_layout(world, node_rank)
    env = node_variables(layout, cpu_count=cpu_count, base_env=base_env)
    cores = None
    if options.bind_cores_to_rank:
        bind = _bind_cores(options, base_env)
        cores = [cores_for_rank(bind, layout.local_size, lr) for lr in range(layout.local_size)]
        env["OMP_NUM_THREADS"] = str(len(cores[0]))  # DeepSpeed's: one thread per bound core
    return {
        "argv": [user_argv(command, lr) for lr in range(layout.local_size)],
        "mode": run_mode(command),
        "env": env,
        "cores": cores,
        "log_dir": options.each_rank_log,
        "log_prefix": log_prefix,
        "stdin_devnull": options.watch_stdin,
    }


def _bind_cores(options: NodeOptions, base_env: Mapping[str, str]) -> list[int]:
    if "KMP_AFFINITY" in base_env:
        raise LauncherError(
            "--bind_cores_to_rank: KMP_AFFINITY is set, and it would override the core binding of "
            "every rank; unset it (unset KMP_AFFINITY) or launch without --bind_cores_to_rank"
        )
    return parse_core_list(options.bind_core_list) if options.bind_core_list else physical_cores()


def agent_job(
    world: Mapping[str, Sequence[int]],
    node_rank: int,
    command: UserCommand,
    options: NodeOptions,
    *,
    base_env: Mapping[str, str],
    cpu_count: int,
    log_prefix: str,
    name: str,
) -> AgentJob:
    """The agent's job for node ``node_rank`` (pure)."""
    if options.max_restarts < 0:
        raise LauncherError(f"--max_restarts must be >= 0, got {options.max_restarts}")
    if options.elastic_training and command.no_local_rank:  # as DeepSpeed
        raise LauncherError("--no_local_rank is not supported with --elastic_training: ranks get --local_rank")
    elastic = (
        elastic_nodes(len(world), options.min_elastic_nodes, options.max_elastic_nodes)
        if options.elastic_training
        else None
    )
    plan = rendezvous_plan(
        master_addr=options.master_addr,
        master_port=options.master_port,
        node_rank=node_rank,
        num_nodes=len(world),
        elastic=elastic,
        env=base_env,
    )
    spec = worker_spec(
        world, node_rank, command, options, base_env=base_env, cpu_count=cpu_count, log_prefix=log_prefix
    )
    return AgentJob(
        plan, len(spec["argv"]), json.dumps(spec), options.max_restarts, options.each_rank_log, log_prefix, name
    )


def run_node(
    world: Mapping[str, Sequence[int]],
    node_rank: int,
    command: UserCommand,
    options: NodeOptions,
    *,
    name: str = "zerospeed",
) -> int:
    """Run node ``node_rank``'s ranks here under torch's elastic agent and return the exit code.

    ``name`` starts the messages about failed ranks.
    """
    if options.each_rank_log:
        _prepare_log_dir(options.each_rank_log)
    job = agent_job(
        world,
        node_rank,
        command,
        options,
        base_env=os.environ,
        cpu_count=available_cpus(),
        log_prefix=time.strftime("%Y%m%d%H%M%S"),
        name=name,
    )
    logger.info(
        "node %d: starting %d rank(s) through torch's elastic agent (rendezvous %s): %s",
        node_rank,
        job.local_world_size,
        job.plan.endpoint,
        user_argv(command, 0),
    )
    with saved_pid(options.save_pid):
        return run_agent(job, watch_stdin=options.watch_stdin)


def _prepare_log_dir(path: str) -> None:
    if os.path.isfile(path):
        raise LauncherError(f"--enable_each_rank_log {path!r} is a file; it must name a directory")
    os.makedirs(path, exist_ok=True)


def node_rank_from_env(env: Mapping[str, str]) -> int:
    """This node's index as set by mpirun or srun (one node launcher per node)."""
    for name in NODE_RANK_ENV_VARS:
        if name in env:
            if not env[name].isdigit():
                raise LauncherError(f"--node_rank_from_env: {name}={env[name]!r} is not a node index")
            return int(env[name])
    raise LauncherError(
        f"--node_rank_from_env: none of {', '.join(NODE_RANK_ENV_VARS)} is set; "
        "this process was not started by mpirun or srun"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerospeed.launcher.node",
        allow_abbrev=False,
        usage="%(prog)s [options] -- user_script [user_args ...]",
        description="zerospeed per-node launcher (started by zerospeed's runners)",
    )
    p.add_argument("--world_info", required=True, help="base64 JSON {host: [slot, ...]}")
    rank = p.add_mutually_exclusive_group(required=True)
    rank.add_argument("--node_rank", type=int, help="index of this node in the world")
    rank.add_argument("--node_rank_from_env", action="store_true", help="read it from the MPI/Slurm env")
    p.add_argument("--master_addr", required=True)
    p.add_argument("--master_port", type=int, required=True)
    for flag in ("--module", "--no_python", "--no_local_rank", "--watch_stdin"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--enable_each_rank_log", default=None)
    p.add_argument("--save_pid", type=int, default=None)
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--max_restarts", type=int, default=0)
    p.add_argument("--elastic_training", action="store_true")
    p.add_argument("--min_elastic_nodes", type=int, default=None)
    p.add_argument("--max_elastic_nodes", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m zerospeed.launcher.node``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        _parser().error("missing '-- user_script [user_args ...]'")
    cut = argv.index("--")
    args = _parser().parse_args(argv[:cut])
    logging.basicConfig(level=logging.INFO, format="[zerospeed node] %(message)s")
    try:
        node_rank = node_rank_from_env(os.environ) if args.node_rank_from_env else args.node_rank
        command = UserCommand(
            argv[cut + 1],
            tuple(argv[cut + 2 :]),
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
        )
        options = NodeOptions(
            args.master_addr,
            args.master_port,
            args.enable_each_rank_log,
            args.save_pid,
            args.watch_stdin,
            args.bind_cores_to_rank,
            args.bind_core_list,
            args.max_restarts,
            args.elastic_training,
            args.min_elastic_nodes,
            args.max_elastic_nodes,
        )
        return run_node(
            decode_world_info(args.world_info), node_rank, command, options, name=f"zerospeed node {node_rank}"
        )
    except LauncherError as err:
        print(f"zerospeed node launcher: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
