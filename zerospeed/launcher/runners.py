"""Multi-node runners: the command lines that start one node launcher per node (pure functions).

Every runner starts ``python -m zerospeed.launcher.node`` once per node; that process starts the
node's ranks (see ``node.py``). Runners differ in how they reach the nodes and tell each launcher
its node index: pdsh, ssh and local bake it in (one command per node), and mpirun/srun set an
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
KILL_POLL_S = 0.2  # how often the remote kill line checks whether the node launchers are gone
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

    world_info: str  # encode_world_info(world)
    master_addr: str
    master_port: int
    command: UserCommand
    each_rank_log: str | None = None
    save_pid: int | None = None
    python: str = sys.executable  # assumed to be the same path on every node, as DeepSpeed does
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    max_restarts: int = 0  # torch's elastic agent on every node (node.py)
    elastic_training: bool = False
    min_elastic_nodes: int | None = None
    max_elastic_nodes: int | None = None


def node_launcher_argv(nc: NodeCommand, node_rank: int | str | None, *, watch_stdin: bool = False) -> list[str]:
    """argv of one node launcher; ``node_rank=None`` makes it read its index from MPI/Slurm variables."""
    rank_flag = "--node_rank_from_env" if node_rank is None else f"--node_rank={node_rank}"
    argv = [
        nc.python,
        "-u",
        "-m",
        NODE_MODULE,
        f"--world_info={nc.world_info}",
        rank_flag,
        f"--master_addr={nc.master_addr}",
        f"--master_port={nc.master_port}",
    ]
    cmd = nc.command
    argv += [
        flag
        for flag, on in (
            ("--module", cmd.module),
            ("--no_python", cmd.no_python),
            ("--no_local_rank", cmd.no_local_rank),
            ("--watch_stdin", watch_stdin),
        )
        if on
    ]
    if nc.each_rank_log:
        argv.append(f"--enable_each_rank_log={nc.each_rank_log}")
    if nc.save_pid is not None:
        argv.append(f"--save_pid={nc.save_pid}")
    if nc.bind_cores_to_rank:
        argv.append("--bind_cores_to_rank")
    if nc.bind_core_list:
        argv.append(f"--bind_core_list={nc.bind_core_list}")
    return argv + _agent_flags(nc) + ["--", cmd.script, *cmd.args]


def _agent_flags(nc: NodeCommand) -> list[str]:
    """The elastic agent's flags, each only when not the default (so plain jobs' lines are unchanged)."""
    flags = [f"--max_restarts={nc.max_restarts}"] if nc.max_restarts else []
    if nc.elastic_training:
        flags.append("--elastic_training")
        flags += [
            f"--{name}={value}"
            for name, value in (
                ("min_elastic_nodes", nc.min_elastic_nodes),
                ("max_elastic_nodes", nc.max_elastic_nodes),
            )
            if value is not None
        ]
    return flags


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


def pdsh_commands(
    hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str], cwd: str, launcher_args: Sequence[str] = ()
) -> list[list[str]]:
    """One pdsh per host, each with its node index baked in.

    Note [one pdsh per node]: one ``pdsh -w all,hosts`` (DeepSpeed's, with ``%n`` for the index)
    exits only when every host's command has: a node that fails leaves the job running until the
    others end by themselves, which ranks blocked in a collective or an exit barrier may never do.
    With one pdsh per node the supervisor sees the first failure and stops the rest (pdsh 2.35's
    ``-k`` would do it for one pdsh; Debian 12 ships 2.34).
    """
    return [
        [*_pdsh_prefix([host]), *launcher_args, remote_shell_command(exports, cwd, node_launcher_argv(nc, i))]
        for i, host in enumerate(hosts)
    ]


def pdsh_kill_command(
    hosts: Sequence[str], nc: NodeCommand, launcher_args: Sequence[str] = (), grace_s: float = 5.0
) -> list[str]:
    """pdsh line that stops this job's node launchers on every host (``kill_line``)."""
    return [*_pdsh_prefix(hosts), *launcher_args, kill_line(nc, grace_s)]


def ssh_kill_commands(
    hosts: Sequence[str],
    nc: NodeCommand,
    *,
    ssh_port: int | None = None,
    launcher_args: Sequence[str] = (),
    grace_s: float = 5.0,
) -> list[list[str]]:
    """One ssh per host that stops this job's node launcher there (``kill_line``)."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [["ssh", "-n", *port, *launcher_args, host, kill_line(nc, grace_s)] for host in hosts]


def kill_line(nc: NodeCommand, grace_s: float) -> str:
    """Shell line that SIGTERMs this job's node launchers (which stop their ranks), then SIGKILLs
    those still running after ``grace_s``.

    Note [kill the node launchers by name]: the processes that started them (ssh, pdsh) dying does
    not stop them: nothing is sent to a remote command without a terminal when its session closes.
    A node launcher busy in native code (torch's store waits) cannot run its SIGTERM handler, hence
    the SIGKILL; its ranks then get SIGTERM from Linux (Note [ranks die with their node launcher]).
    The ``[z]`` keeps the pattern from matching the remote shell that runs this line.
    """
    pattern = shlex.quote(
        rf"[z]erospeed\.launcher\.node --world_info={re.escape(nc.world_info)} "
        rf".*--master_port={nc.master_port} "
    )
    polls = max(1, round(grace_s / KILL_POLL_S))
    return (
        f"pkill -f -- {pattern}; n=0; while [ $n -lt {polls} ] && pgrep -f -- {pattern} >/dev/null; "
        f"do sleep {KILL_POLL_S}; n=$((n + 1)); done; pkill -KILL -f -- {pattern}; true"
    )


def _pdsh_prefix(hosts: Sequence[str]) -> list[str]:
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts)]


def ssh_commands(
    hosts: Sequence[str],
    nc: NodeCommand,
    *,
    exports: Mapping[str, str],
    cwd: str,
    ssh_port: int | None = None,
    launcher_args: Sequence[str] = (),
) -> list[list[str]]:
    """One ssh per host. Each node launcher watches its stdin: it closes when our ssh dies."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [
        [
            "ssh",
            *port,
            *launcher_args,
            host,
            remote_shell_command(exports, cwd, node_launcher_argv(nc, i, watch_stdin=True)),
        ]
        for i, host in enumerate(hosts)
    ]


def openmpi_command(
    hosts: Sequence[str],
    nc: NodeCommand,
    *,
    exports: Mapping[str, str],
    launcher_args: Sequence[str] = (),
    ssh_port: int | None = None,
    inherited_rsh_args: str = "",
) -> list[str]:
    """mpirun (Open MPI) with one node launcher per host, in ``hosts`` order (rank i on host i).

    ``inherited_rsh_args`` is ``$OMPI_MCA_plm_rsh_args``, kept when ``ssh_port`` adds to it.
    """
    return [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        str(len(hosts)),
        "-H",
        ",".join(hosts),
        "--map-by",
        "ppr:1:node",
        "--bind-to",
        "none",
        *with_rsh_port(launcher_args, ssh_port, inherited_rsh_args),
        *_flag_pairs("-x", (f"{k}={v}" for k, v in exports.items())),
        *node_launcher_argv(nc, None),
    ]


def with_rsh_port(launcher_args: Sequence[str], ssh_port: int | None, inherited: str = "") -> list[str]:
    """``launcher_args`` with ``-p ssh_port`` added to Open MPI's ssh options (``--mca plm_rsh_args``).

    Note [ssh port of mpirun]: mpirun reaches the other nodes with its own ssh (its rsh agent), whose
    options are the single MCA value ``plm_rsh_args``. DeepSpeed drops ``--ssh_port`` for openmpi; we
    add the port to that value: to the user's ``--mca plm_rsh_args`` if given, else to the inherited
    ``$OMPI_MCA_plm_rsh_args`` (a command-line value would otherwise silently replace it).
    """
    args = list(launcher_args)
    if ssh_port is None:
        return args
    for i in range(len(args) - 2):
        if args[i] in ("--mca", "-mca") and args[i + 1] == "plm_rsh_args":
            args[i + 2] = f"{args[i + 2]} -p {ssh_port}"
            return args
    return ["--mca", "plm_rsh_args", f"{inherited} -p {ssh_port}".strip(), *args]


def hydra_command(
    hosts: Sequence[str], nc: NodeCommand, *, exports: Mapping[str, str], launcher_args: Sequence[str] = ()
) -> list[str]:
    """mpirun of the hydra family (MPICH, Intel MPI, MVAPICH2) with one node launcher per host."""
    genv = [w for k, v in exports.items() for w in ("-genv", k, v)]
    return [
        "mpirun",
        "-n",
        str(len(hosts)),
        "-ppn",
        "1",
        "-hosts",
        ",".join(hosts),
        *launcher_args,
        *genv,
        *node_launcher_argv(nc, None),
    ]


def slurm_command(
    hosts: Sequence[str], nc: NodeCommand, *, launcher_args: Sequence[str] = (), comment: str = "", account: str = ""
) -> list[str]:
    """srun with one node launcher per host (SLURM_PROCID gives the node index).

    Note [srun exports]: ``--export=ALL`` sends srun's whole environment, so the exports go there
    (``slurm_env``) rather than into ``--export=ALL,K=V``, which splits a value at its commas.
    Note [srun fail-fast]: without ``--kill-on-bad-exit`` srun waits for every task, so a failed node
    would leave the others running; Slurm's default for it is the cluster's ``KillOnBadExit`` (0).
    """
    n = str(len(hosts))
    extra = [*(["--comment", comment] if comment else []), *(["--account", account] if account else [])]
    return [
        "srun",
        "--nodes",
        n,
        "--ntasks",
        n,
        "--ntasks-per-node",
        "1",
        "--nodelist",
        ",".join(hosts),
        "--kill-on-bad-exit=1",
        *launcher_args,
        *extra,
        "--export=ALL",
        *node_launcher_argv(nc, None),
    ]


def slurm_env(env: Mapping[str, str], exports: Mapping[str, str]) -> dict[str, str]:
    """srun's environment: ours and the exports (Note [srun exports])."""
    return {**env, **exports}


def local_commands(hosts: Sequence[str], nc: NodeCommand) -> list[list[str]]:
    """One node launcher per host, all started on this machine (hosts are only labels)."""
    return [node_launcher_argv(nc, i) for i in range(len(hosts))]


def check_runner_world(launcher: str, world: Mapping[str, Sequence[int]]) -> None:
    """srun numbers tasks in its own node order, not ours, so every node must look the same."""
    if launcher == "slurm" and len({tuple(s) for s in world.values()}) > 1:
        raise LauncherError(
            "--launcher slurm needs the same slots on every node, got "
            + ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in world.items())
            + "; use --launcher pdsh or ssh for uneven nodes"
        )


def _flag_pairs(flag: str, values: Iterable[str]) -> list[str]:
    return [w for v in values for w in (flag, v)]
