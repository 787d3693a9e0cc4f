"""The ``zerospeed`` command: DeepSpeed's launch line with ``deepspeed`` replaced by ``zerospeed``.

    zerospeed --num_gpus=8 train.py --deepspeed ds_config.json
    zerospeed --hostfile=hostfile --launcher=ssh train.py --deepspeed ds_config.json
    zerospeed --num_nodes=2 --node_rank=0 --master_addr=HOST train.py   # and node_rank=1 on HOST 2

Everything after the script name is passed to the script untouched, even flags named like ours.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from zerospeed import autotuning
from zerospeed.autotuning.command import TrialWorld
from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.hostfile import DEFAULT_HOSTFILE, read_hostfile
from zerospeed.launcher.multinode import run_multinode
from zerospeed.launcher.node import NodeOptions, run_node
from zerospeed.launcher.plan import make_plan
from zerospeed.launcher.resources import detect_device_count
from zerospeed.launcher.runners import LAUNCHERS

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500  # torch.distributed's default, as in DeepSpeed
ELASTIC_MAX_RESTARTS = 100  # DeepSpeed's fixed value for its elastic agent


def _build_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The launcher's flags, and the option strings that take a value."""
    p = argparse.ArgumentParser(
        prog="zerospeed",
        allow_abbrev=False,
        usage="%(prog)s [options] user_script [user_args ...]",
        description="Launch a (multi-node) multi-process training job, DeepSpeed-style.",
    )
    valued: set[str] = set()

    def value(*names: str, **kw: object) -> None:
        p.add_argument(*names, **kw)
        valued.update(names)

    def flag(*names: str, help: str) -> None:  # noqa: A002 (argparse's name)
        p.add_argument(*names, action="store_true", help=help)

    value(
        "-H",
        "--hostfile",
        default=None,
        help=f"MPI-style hostfile, lines 'HOST slots=N' "
        f"(default {DEFAULT_HOSTFILE}; when that is missing, run on this machine)",
    )
    value(
        "-i",
        "--include",
        default="",
        help="hosts/slots to use: NODE_SPEC[@NODE_SPEC...], "
        "NODE_SPEC=HOST[:SLOT[,SLOT...]], e.g. 'worker-0:0,2@worker-1'",
    )
    value("-e", "--exclude", default="", help="hosts/slots not to use (same syntax as --include)")
    value(
        "--num_nodes",
        type=int,
        default=None,
        help="use the first N hosts; without a hostfile, "
        "the number of separately launched nodes (with --node_rank and --master_addr)",
    )
    value(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=None,
        help="processes per node, on slots 0..N-1 (CPU processes on a machine without GPUs)",
    )
    value("--master_addr", default="", help="address of the node with rank 0")
    value("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="port for torch.distributed")
    value("--node_rank", type=int, default=None, help="launch only this node (0..N-1) of the job")
    value("--launcher", default="pdsh", help=f"multi-node runner: {', '.join(LAUNCHERS)} (default pdsh)")
    value("--launcher_args", default="", help="extra arguments for the runner, as one quoted string")
    value("--enable_each_rank_log", default=None, metavar="DIR", help="write each rank's output to DIR")
    value("--ssh_port", type=int, default=None, help="ssh port for the pdsh and ssh runners")
    value("--comment", default="", help="srun --comment (slurm runner)")
    value("--account", default="", help="srun --account (slurm runner)")
    flag("--module", help="run the script as a module (python -m)")
    flag("--no_python", help="run the script as an executable, without python")
    flag("--no_local_rank", help="do not pass --local_rank=N to the script")
    flag("--no_ssh", help="launch only --node_rank of the hostfile, here (run once on every node)")
    flag("--no_ssh_check", help="accepted for DeepSpeed compatibility (no ssh check is made)")
    flag("--force_multi", help="use the multi-node runner even for a single node")
    flag("--save_pid", help="write the launcher's pid to /tmp/<pid of this command>.deepspeed")
    flag(
        "--bind_cores_to_rank", help="give each local rank its own block of CPU cores (and OMP_NUM_THREADS = its size)"
    )
    value(
        "--bind_core_list",
        default=None,
        help="the cores --bind_cores_to_rank splits, e.g. 0,2-4,6 (default: every physical core)",
    )
    value(
        "--max_restarts",
        type=int,
        default=None,
        help="restart every rank up to N times after a rank fails "
        "(torch's elastic agent; default 0: the job ends with the first failure; 100 with --elastic_training)",
    )
    flag(
        "--elastic_training",
        help="elastic membership: the job runs on --min_elastic_nodes to "
        "--max_elastic_nodes nodes, restarting its ranks when nodes leave or join",
    )
    value("--min_elastic_nodes", type=int, default=-1, help="fewest nodes of an elastic job (default 1)")
    value(
        "--max_elastic_nodes",
        type=int,
        default=-1,
        help="most nodes of an elastic job (default: --num_nodes or the hostfile's)",
    )
    value(
        "--autotuning",
        default=None,
        choices=("tune", "run"),
        help="tune: search ZeRO stages and micro batches "
        "with short trials of the script and write autotuning_results/ds_config_optimal.json; run: tune, then "
        "train with it (the config's autotuning block, docs/autotuning.md)",
    )
    return p, valued


def split_argv(argv: Sequence[str], valued: set[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's options and ``[user_script, *user_args]``.

    The script is the first word that is neither an option nor an option's value (or the word after
    ``--``). Unknown options stay on the launcher side so that argparse reports them.
    """
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not word.startswith("-") or word == "-":
            break
        name = word.split("=", 1)[0]
        i += 2 if name in valued and "=" not in word else 1
    return list(argv[:i]), list(argv[i:])


class _ParseExit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def parse_command_line(argv: Sequence[str]) -> tuple[argparse.Namespace, UserCommand]:
    """Parse the launcher's flags and the user command; bad flags raise ``LauncherError``."""
    parser, valued = _build_parser()
    ours, user = split_argv(argv, valued)
    try:
        args = parser.parse_args(ours)
    except SystemExit as exc:  # argparse printed the usage and the error (or the help)
        raise _ParseExit(int(exc.code or 0)) from None
    if not user:
        raise LauncherError("missing the training script: zerospeed [options] user_script [user_args ...]")
    _normalize(args)
    command = UserCommand(
        user[0], tuple(user[1:]), module=args.module, no_python=args.no_python, no_local_rank=args.no_local_rank
    )
    return args, command


def _normalize(args: argparse.Namespace) -> None:
    for name in ("num_nodes", "num_gpus"):
        value = getattr(args, name)
        if value == -1:  # DeepSpeed's "not set"
            setattr(args, name, None)
        elif value is not None and value < 1:
            raise LauncherError(f"--{name} must be >= 1, got {value}")
    if args.enable_each_rank_log == "None":  # DeepSpeed's "not set"
        args.enable_each_rank_log = None
    if args.bind_core_list is not None and not args.bind_cores_to_rank:  # DeepSpeed ignores it too
        logger.warning("--bind_core_list %s has no effect without --bind_cores_to_rank", args.bind_core_list)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerospeed`` command; returns the exit code (2 for bad flags)."""
    try:
        return launch(argv)
    except _ParseExit as exc:
        return exc.code
    except LauncherError as err:
        print(f"zerospeed: error: {err}", file=sys.stderr)
        return 2


def launch(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ours) and run the job; a bad flag or flag combination raises ``LauncherError``
    (a ``ValueError``), as DeepSpeed's ``runner.main`` raises one (``deepspeed_runner.main``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[zerospeed] %(message)s")
    args, command = parse_command_line(argv)
    if args.autotuning is not None:  # trials and the final run go through this launcher again
        return autotuning.autotune(args.autotuning, argv, command, _trial_world(args))
    return _launch(args, command)


def _trial_world(args: argparse.Namespace) -> TrialWorld:
    """The nodes and ranks the autotuner's trials get: what this launcher makes of the same flags."""
    hostfile = read_hostfile(args.hostfile)
    plan = make_plan(args, hostfile, os.environ.get("CUDA_VISIBLE_DEVICES", ""), detect_device_count)
    return TrialWorld(tuple(len(slots) for slots in plan.world.values()), hostfile=hostfile is not None)


def _launch(args: argparse.Namespace, command: UserCommand) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and args.num_gpus is not None:
        logger.info("ignoring CUDA_VISIBLE_DEVICES=%s because --num_gpus is given", visible)
    plan = make_plan(args, read_hostfile(args.hostfile), visible, detect_device_count)
    if plan.node_rank is not None:
        options = NodeOptions(
            plan.master_addr,
            args.master_port,
            args.enable_each_rank_log,
            save_pid=os.getpid() if args.save_pid else None,
            bind_cores_to_rank=args.bind_cores_to_rank,
            bind_core_list=args.bind_core_list,
            **_agent_flags(args),
        )
        return run_node(plan.world, plan.node_rank, command, options)
    return run_multinode(
        plan,
        command,
        master_port=args.master_port,
        each_rank_log=args.enable_each_rank_log,
        save_pid=args.save_pid,
        launcher_args=args.launcher_args,
        ssh_port=args.ssh_port,
        comment=args.comment,
        account=args.account,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        **_agent_flags(args),
    )


def _agent_flags(args: argparse.Namespace) -> dict[str, object]:
    """The flags for torch's elastic agent on every node (DeepSpeed's -1 = not set)."""
    if args.max_restarts is None:  # a node leaving an elastic job fails its peers' ranks: a restart each time
        args.max_restarts = ELASTIC_MAX_RESTARTS if args.elastic_training else 0
    if args.max_restarts < 0:
        raise LauncherError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if not args.elastic_training and (args.min_elastic_nodes, args.max_elastic_nodes) != (-1, -1):
        logger.warning("--min_elastic_nodes/--max_elastic_nodes have no effect without --elastic_training")
    unset = (None, -1)
    return {
        "max_restarts": args.max_restarts,
        "elastic_training": args.elastic_training,
        "min_elastic_nodes": None if args.min_elastic_nodes in unset else args.min_elastic_nodes,
        "max_elastic_nodes": None if args.max_elastic_nodes in unset else args.max_elastic_nodes,
    }
