"""The per-node launcher: starts and supervises the rank processes of one node.

Multi-node runners (pdsh, ssh, mpirun, srun, local) start one of these per node as
``python -m zerospeed.launcher.node --world_info=... --node_rank=N ... -- script args``; the
single-node path of ``zerospeed`` calls ``run_node`` in its own process.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerospeed.launcher.cores import cores_for_rank, parse_core_list, physical_cores
from zerospeed.launcher.environment import UserCommand, available_cpus, rank_argv, rank_environment
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.local import ChildSpec, run_children
from zerospeed.launcher.pidfile import saved_pid
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
    each_rank_log: str | None = None   # directory for one ``<time>_rank<N>.log`` per rank
    save_pid: int | None = None        # main pid naming the ``--save_pid`` file
    watch_stdin: bool = False          # stop when stdin closes (the ssh runner's launcher is gone)
    bind_cores_to_rank: bool = False   # give each local rank its own block of cores (launcher/cores.py)
    bind_core_list: str | None = None  # the cores to split ("0,2-4,6"); default: every physical core


def rank_specs(world: Mapping[str, Sequence[int]], node_rank: int, command: UserCommand,
               options: NodeOptions, *, base_env: Mapping[str, str], cpu_count: int,
               log_prefix: str = "", python: str = sys.executable) -> list[ChildSpec]:
    """What to start for each local rank of node ``node_rank`` (pure)."""
    layout = node_layout(world, node_rank)
    bind_cores = _bind_cores(options, base_env) if options.bind_cores_to_rank else []
    specs = []
    for local_rank in range(layout.local_size):
        rank = layout.global_rank(local_rank)
        log = (os.path.join(options.each_rank_log, f"{log_prefix}_rank{rank}.log")
               if options.each_rank_log else None)
        env = rank_environment(layout, local_rank, master_addr=options.master_addr,
                               master_port=options.master_port, cpu_count=cpu_count, base_env=base_env)
        affinity = None
        if options.bind_cores_to_rank:
            affinity = tuple(cores_for_rank(bind_cores, layout.local_size, local_rank))
            env["OMP_NUM_THREADS"] = str(len(affinity))  # DeepSpeed's: one thread per bound core
        specs.append(ChildSpec(label=f"rank {rank}", argv=rank_argv(command, local_rank, python), env=env,
                               log_path=log, stdin="devnull" if options.watch_stdin else "inherit",
                               cpu_affinity=affinity))
    return specs


def _bind_cores(options: NodeOptions, base_env: Mapping[str, str]) -> list[int]:
    if "KMP_AFFINITY" in base_env:
        raise LauncherError("--bind_cores_to_rank: KMP_AFFINITY is set, and it would override the core binding of "
                            "every rank; unset it (unset KMP_AFFINITY) or launch without --bind_cores_to_rank")
    return parse_core_list(options.bind_core_list) if options.bind_core_list else physical_cores()


def run_node(world: Mapping[str, Sequence[int]], node_rank: int, command: UserCommand,
             options: NodeOptions, *, name: str = "zerospeed") -> int:
    """Start node ``node_rank``'s ranks here, supervise them, and return the exit code.

    ``name`` starts the messages about failed ranks.
    """
    if options.each_rank_log:
        _prepare_log_dir(options.each_rank_log)
    specs = rank_specs(world, node_rank, command, options, base_env=os.environ, cpu_count=available_cpus(),
                       log_prefix=time.strftime("%Y%m%d%H%M%S"))
    logger.info("node %d: starting ranks %s: %s", node_rank, [s.label for s in specs], specs[0].argv)
    with saved_pid(options.save_pid):
        return run_children(specs, eof_fd=sys.stdin.fileno() if options.watch_stdin else None, name=name)


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
    raise LauncherError(f"--node_rank_from_env: none of {', '.join(NODE_RANK_ENV_VARS)} is set; "
                        "this process was not started by mpirun or srun")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerospeed.launcher.node", allow_abbrev=False,
                                usage="%(prog)s [options] -- user_script [user_args ...]",
                                description="zerospeed per-node launcher (started by zerospeed's runners)")
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
        command = UserCommand(argv[cut + 1], tuple(argv[cut + 2:]), module=args.module,
                              no_python=args.no_python, no_local_rank=args.no_local_rank)
        options = NodeOptions(args.master_addr, args.master_port, args.enable_each_rank_log,
                              args.save_pid, args.watch_stdin, args.bind_cores_to_rank, args.bind_core_list)
        return run_node(decode_world_info(args.world_info), node_rank, command, options,
                        name=f"zerospeed node {node_rank}")
    except LauncherError as err:
        print(f"zerospeed node launcher: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
