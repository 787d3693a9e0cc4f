"""Multi-node runners: the command lines that start one node launcher per node (pure functions).

Every runner starts ``python -m zerospeed.launcher.node`` once per node; that process starts the
node's ranks (see ``node.py``). Runners differ in how they reach the nodes and tell each launcher
its node index: pdsh substitutes ``%n``, ssh and local bake it in, and mpirun/srun set an
environment variable that ``--node_rank_from_env`` reads.
"""
from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError

LAUNCHERS = ("pdsh", "ssh", "openmpi", "mvapich", "mpich", "impi", "slurm", "local")
PDSH_MAX_FAN_OUT = 1024
NODE_MODULE = "zerospeed.launcher.node"

# Variables sent to remote nodes when set here: DeepSpeed's list (NCCL, PYTHON*, MV2, UCX, MLFLOW)
# plus the ones that steer torch.distributed on CPU (GLOO_SOCKET_IFNAME) or debugging (TORCH_*).
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW", "GLOO", "TORCH", "ZEROSPEED")

# Settings a runner needs for the node launcher to use all of the node's cores: MPI launchers
# otherwise pin each process, and the ranks would inherit a single core.
RUNNER_EXPORTS = {"mvapich": {"MV2_ENABLE_AFFINITY": "0"}, "impi": {"I_MPI_PIN": "0"}}


@dataclass(frozen=True)
class NodeCommand:
    """What every node launcher of a job is told."""

    world_info: str                  # encode_world_info(world)
    master_addr: str
    master_port: int
    command: UserCommand
    each_rank_log: str | None = None
    save_pid: int | None = None
    python: str = sys.executable     # assumed to be the same path on every node, as DeepSpeed does
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None


def node_launcher_argv(nc: NodeCommand, node_rank: int | str | None, *, watch_stdin: bool = False) -> list[str]:
    """argv of one node launcher; ``node_rank=None`` makes it read its index from MPI/Slurm variables."""
    rank_flag = "--node_rank_from_env" if node_rank is None else f"--node_rank={node_rank}"
    argv = [nc.python, "-u", "-m", NODE_MODULE, f"--world_info={nc.world_info}", rank_flag,
            f"--master_addr={nc.master_addr}", f"--master_port={nc.master_port}"]
    cmd = nc.command
    argv += [flag for flag, on in (("--module", cmd.module), ("--no_python", cmd.no_python),
                                   ("--no_local_rank", cmd.no_local_rank), ("--watch_stdin", watch_stdin)) if on]
    if nc.each_rank_log:
        argv.append(f"--enable_each_rank_log={nc.each_rank_log}")
    if nc.save_pid is not None:
        argv.append(f"--save_pid={nc.save_pid}")
    if nc.bind_cores_to_rank:
        argv.append("--bind_cores_to_rank")
    if nc.bind_core_list:
        argv.append(f"--bind_core_list={nc.bind_core_list}")
    return argv + ["--", cmd.script, *cmd.args]


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of a ``.deepspeed_env`` file (blank lines and ``#`` comments skipped)."""
    exports = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise LauncherError(f"{source}:{lineno}: bad line {line!r}; expected KEY=VALUE")
        exports[key.strip()] = value.strip()
    return exports


def collect_exports(env: Mapping[str, str], extra: Mapping[str, str] = ()) -> dict[str, str]:
    """Variables to set on remote nodes: ``env`` entries with an exported prefix, then ``extra``."""
    exports = {k: v for k, v in env.items() if k.startswith(EXPORT_PREFIXES)}
    exports.update(extra)
    return exports


def remote_shell_command(exports: Mapping[str, str], cwd: str, argv: Sequence[str]) -> str:
    """One shell line that sets ``exports``, enters ``cwd`` and runs ``argv`` (each word quoted)."""
    parts = [f"export {k}={shlex.quote(v)};" for k, v in exports.items()]
    parts += [f"cd {shlex.quote(cwd)};", shlex.join(argv)]
    return " ".join(parts)


def pdsh_command(hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str], cwd: str,
                 launcher_args: Sequence[str] = ()) -> list[str]:
    """pdsh runs the same line on every host; it replaces ``%n`` with the host's index in ``-w``."""
    return [*_pdsh_prefix(hosts), *launcher_args,
            remote_shell_command(exports, cwd, node_launcher_argv(nc, "%n"))]


def pdsh_kill_command(hosts: Sequence[str], nc: NodeCommand, launcher_args: Sequence[str] = ()) -> list[str]:
    """pdsh line that SIGTERMs this job's node launchers (which then stop their ranks).

    The ``[z]`` keeps the pattern from matching the remote shell that runs pkill itself.
    """
    pattern = (rf"[z]erospeed\.launcher\.node --world_info={re.escape(nc.world_info)} "
               rf".*--master_port={nc.master_port} ")
    return [*_pdsh_prefix(hosts), *launcher_args, f"pkill -f -- {shlex.quote(pattern)}"]


def _pdsh_prefix(hosts: Sequence[str]) -> list[str]:
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts)]


def ssh_commands(hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str], cwd: str,
                 ssh_port: int | None = None, launcher_args: Sequence[str] = ()) -> list[list[str]]:
    """One ssh per host. Each node launcher watches its stdin: it closes when our ssh dies."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [["ssh", *port, *launcher_args, host,
             remote_shell_command(exports, cwd, node_launcher_argv(nc, i, watch_stdin=True))]
            for i, host in enumerate(hosts)]


def openmpi_command(hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str],
                    launcher_args: Sequence[str] = ()) -> list[str]:
    """mpirun (Open MPI) with one node launcher per host, in ``hosts`` order (rank i on host i)."""
    return ["mpirun", "--allow-run-as-root", "-np", str(len(hosts)), "-H", ",".join(hosts),
            "--map-by", "ppr:1:node", "--bind-to", "none", *launcher_args,
            *_flag_pairs("-x", (f"{k}={v}" for k, v in exports.items())),
            *node_launcher_argv(nc, None)]


def hydra_command(hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str],
                  launcher_args: Sequence[str] = ()) -> list[str]:
    """mpirun of the hydra family (MPICH, Intel MPI, MVAPICH2) with one node launcher per host."""
    genv = [w for k, v in exports.items() for w in ("-genv", k, v)]
    return ["mpirun", "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts), *launcher_args,
            *genv, *node_launcher_argv(nc, None)]


def slurm_command(hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str],
                  launcher_args: Sequence[str] = (), comment: str = "", account: str = "") -> list[str]:
    """srun with one node launcher per host (SLURM_PROCID gives the node index)."""
    n = str(len(hosts))
    extra = [*(["--comment", comment] if comment else []), *(["--account", account] if account else [])]
    export = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in exports.items())])
    return ["srun", "--nodes", n, "--ntasks", n, "--ntasks-per-node", "1", "--nodelist", ",".join(hosts),
            *launcher_args, *extra, export, *node_launcher_argv(nc, None)]


def local_commands(hosts: Sequence[str], nc: NodeCommand) -> list[list[str]]:
    """One node launcher per host, all started on this machine (hosts are only labels)."""
    return [node_launcher_argv(nc, i) for i in range(len(hosts))]


def check_runner_world(launcher: str, world: Mapping[str, Sequence[int]]) -> None:
    """srun numbers tasks in its own node order, not ours, so every node must look the same."""
    if launcher == "slurm" and len({tuple(s) for s in world.values()}) > 1:
        raise LauncherError("--launcher slurm needs the same slots on every node, got "
                            + ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in world.items())
                            + "; use --launcher pdsh or ssh for uneven nodes")


def _flag_pairs(flag: str, values: Iterable[str]) -> list[str]:
    return [w for v in values for w in (flag, v)]
