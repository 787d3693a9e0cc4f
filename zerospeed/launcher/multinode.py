"""Running a multi-node plan: build the chosen runner's commands and supervise them."""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping

from zerospeed.launcher import runners as r
from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.local import GRACE_S, ChildSpec, run_children
from zerospeed.launcher.pidfile import saved_pid
from zerospeed.launcher.plan import LaunchPlan
from zerospeed.launcher.world import decode_world_info, encode_world_info, node_layout

logger = logging.getLogger(__name__)

BACKEND_BINARY = {
    "pdsh": "pdsh",
    "ssh": "ssh",
    "openmpi": "mpirun",
    "mvapich": "mpirun",
    "mpich": "mpirun",
    "impi": "mpirun",
    "slurm": "srun",
}
# Node launchers get this long to stop their ranks (GRACE_S) before we SIGKILL them.
NODE_GRACE_S = GRACE_S + 2.0
# The remote kill commands' own wait (NODE_GRACE_S) plus connecting to every node.
KILL_TIMEOUT_S = NODE_GRACE_S + 10.0
ENV_FILE_NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")  # DeepSpeed's per-user export file
ENV_FILE_DIRS = (os.path.expanduser("~"), ".")


def run_multinode(
    plan: LaunchPlan,
    command: UserCommand,
    *,
    master_port: int,
    each_rank_log: str | None,
    save_pid: bool,
    launcher_args: str = "",
    ssh_port: int | None = None,
    comment: str = "",
    account: str = "",
    bind_cores_to_rank: bool = False,
    bind_core_list: str | None = None,
    max_restarts: int = 0,
    elastic_training: bool = False,
    min_elastic_nodes: int | None = None,
    max_elastic_nodes: int | None = None,
) -> int:
    """Start one node launcher per node of ``plan.world`` with ``plan.launcher``; return the exit code."""
    r.check_runner_world(plan.launcher, plan.world)
    remote = plan.launcher != "local"
    nc = r.NodeCommand(
        encode_world_info(plan.world),
        plan.master_addr,
        master_port,
        command,
        each_rank_log,
        save_pid=os.getpid() if save_pid and remote else None,
        bind_cores_to_rank=bind_cores_to_rank,
        bind_core_list=bind_core_list,
        max_restarts=max_restarts,
        elastic_training=elastic_training,
        min_elastic_nodes=min_elastic_nodes,
        max_elastic_nodes=max_elastic_nodes,
    )
    hosts = list(plan.world)
    logger.info(
        "%s runner: %d node(s) %s, master %s:%d", plan.launcher, len(hosts), plan.world, plan.master_addr, master_port
    )
    if not remote:
        specs = [
            ChildSpec(node_label(plan.world, i), argv, dict(os.environ))
            for i, argv in enumerate(r.local_commands(hosts, nc))
        ]
        with saved_pid(os.getpid() if save_pid else None):
            return run_children(specs, grace_s=NODE_GRACE_S)
    _check_backend(plan.launcher)
    env = _remote_env(os.environ)
    exports = {**r.RUNNER_EXPORTS.get(plan.launcher, {}), **r.collect_exports(env, _read_env_files())}
    args = shlex.split(launcher_args)
    return _run_remote(plan.launcher, hosts, nc, env, exports, args, ssh_port, comment, account)


def _run_remote(
    launcher: str,
    hosts: list[str],
    nc: r.NodeCommand,
    env: dict[str, str],
    exports: dict[str, str],
    args: list[str],
    ssh_port: int | None,
    comment: str,
    account: str,
) -> int:
    cwd = os.path.abspath(".")
    world = nc_world(nc)
    if launcher == "ssh":
        cmds = r.ssh_commands(hosts, nc, exports=exports, cwd=cwd, ssh_port=ssh_port, launcher_args=args)
        specs = [ChildSpec(node_label(world, i), c, env, stdin="pipe") for i, c in enumerate(cmds)]
        kill = r.ssh_kill_commands(hosts, nc, ssh_port=ssh_port, launcher_args=args, grace_s=NODE_GRACE_S)
        return run_children(specs, grace_s=NODE_GRACE_S, on_stop=lambda: _run_quietly(kill, env))
    if launcher == "pdsh":
        _set_pdsh_env(env, ssh_port)
        cmds = r.pdsh_commands(hosts, nc, exports=exports, cwd=cwd, launcher_args=args)
        specs = [ChildSpec(node_label(world, i), c, env) for i, c in enumerate(cmds)]
        kill = [r.pdsh_kill_command(hosts, nc, args, grace_s=NODE_GRACE_S)]
        return run_children(specs, grace_s=NODE_GRACE_S, on_stop=lambda: _run_quietly(kill, env))
    if launcher == "slurm":
        cmd = r.slurm_command(hosts, nc, launcher_args=args, comment=comment, account=account)
        env = r.slurm_env(env, exports)
    elif launcher == "openmpi":
        cmd = r.openmpi_command(
            hosts,
            nc,
            exports=exports,
            launcher_args=args,
            ssh_port=ssh_port,
            inherited_rsh_args=env.get("OMPI_MCA_plm_rsh_args", ""),
        )
    else:
        cmd = r.hydra_command(hosts, nc, exports=exports, launcher_args=args)
    return run_children([ChildSpec(launcher, cmd, env)], grace_s=NODE_GRACE_S)


def node_label(world: Mapping[str, list[int]], node_rank: int) -> str:
    """How messages name a node: ``node 1 on worker-1 (ranks 2-3)``, so a lost node names its ranks."""
    layout = node_layout(world, node_rank)
    first, last = layout.first_rank, layout.first_rank + layout.local_size - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"node {node_rank} on {list(world)[node_rank]} ({ranks})"


def nc_world(nc: r.NodeCommand) -> dict[str, list[int]]:
    """The world a ``NodeCommand`` carries."""
    return decode_world_info(nc.world_info)


def _check_backend(launcher: str) -> None:
    binary = BACKEND_BINARY[launcher]
    if shutil.which(binary) is None:
        raise LauncherError(
            f"--launcher {launcher} needs '{binary}' on PATH, which is missing; install it "
            f"or choose another of {', '.join(r.LAUNCHERS)}"
        )


def _remote_env(env: Mapping[str, str]) -> dict[str, str]:
    """Our environment, with the working directory first on PYTHONPATH (as DeepSpeed does) so the
    user's local modules import on every node."""
    out = dict(env)
    cwd = os.path.abspath(".")
    out["PYTHONPATH"] = f"{cwd}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else cwd
    return out


def _read_env_files() -> dict[str, str]:
    exports: dict[str, str] = {}
    for directory in ENV_FILE_DIRS:
        path = os.path.join(directory, ENV_FILE_NAME)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                exports.update(r.parse_env_file(f.read(), path))
            logger.info("exporting the variables of %s", path)
    return exports


def _set_pdsh_env(env: dict[str, str], ssh_port: int | None) -> None:
    env["PDSH_RCMD_TYPE"] = "ssh"
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()


def _run_quietly(cmds: list[list[str]], env: dict[str, str]) -> None:
    """Run the remote kill commands, all at once; their output (pdsh reports "exit code 1" for a
    node with nothing left to kill) is only logged."""
    procs = []
    for cmd in cmds:
        try:  # own session: a second Ctrl-C must not interrupt the clean-up
            procs.append(
                (
                    cmd,
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    ),
                )
            )
        except OSError as err:
            logger.warning("could not stop the remote processes with %s: %s", shlex.join(cmd), err)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for cmd, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            logger.debug("%s: %s", shlex.join(cmd), out.strip())
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            logger.warning("could not stop the remote processes within %.0f s with %s", KILL_TIMEOUT_S, shlex.join(cmd))
