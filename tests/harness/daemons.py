"""Real daemons for multi-node launcher tests: a throw-away sshd and a throw-away Slurm cluster, on loopback.

Note [two nodes on one machine]: on Linux all of 127.0.0.0/8 is loopback, so 127.0.0.1 and 127.0.0.2
are two addresses of this machine that ssh, pdsh and mpirun treat as two hosts. An sshd listening on
both (and on nothing else: it accepts a throw-away key, so it must not be reachable from the network)
makes a two-node cluster whose "remote" processes really are started by sshd sessions. Every process
of node 127.0.0.2 carries ``SSH_CONNECTION=... 127.0.0.2 <port>``, which is how tests tell the nodes
apart. Slurm gets the same from two slurmd daemons on this host (``slurmd -N n1``, ``-N n2``), each
a node of its own (``SLURMD_NODENAME``).

    with loopback_sshd(tmp_dir) as sshd:
        subprocess.run(["ssh", "-F", str(sshd.ssh_config), "-p", str(sshd.port), "127.0.0.2", "true"])

A job's processes are found by ``JOB_VAR`` in their environment (the runners send ``ZEROSPEED*``
variables to every node) and by descent from the daemons, so tests can check that none is left.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from zerospeed.utils.ports import free_port

NODE_ADDRS = ("127.0.0.1", "127.0.0.2")
SLURM_NODES = ("n1", "n2")
SBIN_PATH = "/usr/sbin:/usr/local/sbin"
_SSH = ("sshd", "ssh", "ssh-keygen")
# What each launcher's real-daemon test needs; scripts/install_daemons.sh installs the Debian packages.
PROGRAMS = {
    "ssh": _SSH,
    "pdsh": (*_SSH, "pdsh"),
    "openmpi": (*_SSH, "mpirun"),
    "slurm": ("munged", "slurmctld", "slurmd", "srun", "sinfo"),
}
PACKAGES = {
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "pdsh": "pdsh",
    "mpirun": "openmpi-bin",
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "sinfo": "slurm-client",
}
# Set in CI: a missing daemon fails the tests instead of skipping them.
REQUIRE_ENV = "ZEROSPEED_REQUIRE_DAEMONS"
# Tags every process of a test job (the runners export ZEROSPEED* variables to every node).
JOB_VAR = "ZEROSPEED_TEST_JOB"
PRIVSEP_DIR = "/run/sshd"  # Debian's sshd refuses to start without it
START_TIMEOUT_S = 20


class DaemonError(RuntimeError):
    """A daemon did not start or does not let us in; the message holds its log."""


def which(program: str) -> str | None:
    """``program``'s path, also looking in the sbin directories (sshd, slurmd) that a user's PATH may lack."""
    return shutil.which(program) or shutil.which(program, path=SBIN_PATH)


def missing_programs(launcher: str) -> list[str]:
    """What ``launcher``'s real-daemon test needs and does not have: programs, and "root" (sshd's
    privilege-separation directory, slurmd starting jobs, are root's)."""
    missing = [p for p in PROGRAMS[launcher] if which(p) is None]
    return missing + ([] if os.geteuid() == 0 else ["root"])


def missing_reason(launcher: str, missing: Sequence[str]) -> str:
    """A skip reason loud enough to be noticed in a CI log."""
    packages = sorted({PACKAGES[p] for p in missing if p in PACKAGES})
    return (
        f"!!! --launcher {launcher} NOT TESTED against real daemons: {', '.join(missing)} missing; "
        f"run scripts/install_daemons.sh (as root: apt-get install {' '.join(packages)}) and the tests as "
        f"root; {REQUIRE_ENV}=1 turns this skip into a failure !!!"
    )


# ---------------------------------------------------------------------------------------------- sshd


@dataclass
class LoopbackSshd:
    """A running sshd on ``hosts``:``port`` that lets this user in with the key that ``ssh_config`` names."""

    directory: Path
    port: int
    hosts: tuple[str, ...]
    proc: subprocess.Popen

    @property
    def ssh_config(self) -> Path:
        """ssh client options (key, no host-key checks), everything but the port: ``ssh -F`` it."""
        return self.directory / "ssh_config"

    @property
    def log(self) -> str:
        return (self.directory / "sshd.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop sshd and whatever its sessions left behind."""
        _kill_all(_with_descendants([self.proc.pid]))
        self.proc.wait(timeout=5)


def start_sshd(directory: Path, hosts: Sequence[str] = NODE_ADDRS, *, attempts: int = 3) -> LoopbackSshd:
    """Keys, configs and a running sshd in ``directory``; raises ``DaemonError`` if it cannot log in."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_keys(directory)
    _ensure_dir(PRIVSEP_DIR, "sshd")
    for _ in range(attempts):
        sshd = _try_start_sshd(directory, tuple(hosts), free_port(hosts))
        if sshd is not None:
            _check_login(sshd)
            return sshd
    raise DaemonError(f"sshd did not start after {attempts} attempts:\n{_read(directory / 'sshd.log')}")


@contextmanager
def loopback_sshd(directory: Path, hosts: Sequence[str] = NODE_ADDRS) -> Iterator[LoopbackSshd]:
    sshd = start_sshd(directory, hosts)
    try:
        yield sshd
    finally:
        sshd.stop()


def _write_keys(directory: Path) -> None:
    for name in ("host_key", "client_key"):
        if not (directory / name).exists():
            subprocess.run(
                [
                    which("ssh-keygen") or "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "zerospeed-test",
                    "-f",
                    str(directory / name),
                ],
                check=True,
                timeout=30,
            )
    shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
    (directory / "ssh_config").write_text(
        "Host *\n"
        f"  IdentityFile {directory / 'client_key'}\n"
        "  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n"
        "  BatchMode yes\n"
        "  LogLevel ERROR\n"
    )


def _sshd_config(directory: Path, hosts: tuple[str, ...], port: int) -> Path:
    path = directory / "sshd_config"
    listen = "".join(f"ListenAddress {h}\n" for h in hosts)
    # Note [sshd without PAM]: PAM's session modules (pam_loginuid) fail in containers; without PAM
    # only key authentication is left, which is all a test needs.
    path.write_text(
        f"Port {port}\n{listen}"
        f"HostKey {directory / 'host_key'}\n"
        f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
        f"PidFile {directory / 'sshd.pid'}\n"
        f"AllowUsers {getpass.getuser()}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nUseDNS no\nPrintMotd no\nPrintLastLog no\nLogLevel ERROR\n"
    )
    return path


def _try_start_sshd(directory: Path, hosts: tuple[str, ...], port: int) -> LoopbackSshd | None:
    config = _sshd_config(directory, hosts, port)
    # -D: stay in the foreground (our child, stopped by us); -e: log to the file, not syslog.
    proc = _start([_need("sshd"), "-D", "-e", "-f", str(config)], directory / "sshd.log")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None  # most likely the port was taken meanwhile; the caller retries on another
        if all(_accepts(h, port) for h in hosts):
            return LoopbackSshd(directory, port, hosts, proc)
        time.sleep(0.05)
    _kill_all(_with_descendants([proc.pid]))
    raise DaemonError(
        f"sshd did not listen on {hosts} port {port} within {START_TIMEOUT_S} s:\n{_read(directory / 'sshd.log')}"
    )


def _check_login(sshd: LoopbackSshd) -> None:
    for host in sshd.hosts:
        cmd = [_need("ssh"), "-F", str(sshd.ssh_config), "-p", str(sshd.port), host, "true"]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            log = sshd.log
            sshd.stop()
            raise DaemonError(
                f"cannot log in to the test sshd: {' '.join(cmd)} exited with "
                f"{result.returncode}: {result.stderr.strip()}\nsshd log:\n{log}"
            )


# --------------------------------------------------------------------------------------------- Slurm


@dataclass
class LocalSlurm:
    """munged + slurmctld + one slurmd per node, all on this host; ``env`` points srun at them."""

    directory: Path
    nodes: tuple[str, ...]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.directory / "slurm.conf")}

    @property
    def node_pids(self) -> list[int]:
        """The slurmd daemons (the job's steps descend from them)."""
        return [p.pid for p in self.procs if os.path.basename(p.args[0]) == "slurmd"]

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{_read(p)[-3000:]}" for p in sorted(self.directory.glob("*.log")))

    def stop(self) -> None:
        for proc in reversed(self.procs):  # slurmd first, munged (which the others use) last
            _kill_all(_with_descendants([proc.pid]))
            proc.wait(timeout=5)


def start_slurm(directory: Path, nodes: Sequence[str] = SLURM_NODES) -> LocalSlurm:
    """A Slurm cluster of ``nodes`` on this host, in ``directory``; raises ``DaemonError`` if its
    nodes do not come up."""
    directory.mkdir(parents=True, exist_ok=True)
    slurm = LocalSlurm(directory, tuple(nodes))
    try:
        _start_munged(slurm)
        conf = _slurm_conf(directory, slurm.nodes)
        slurm.procs.append(_start([_need("slurmctld"), "-D", "-f", str(conf)], directory / "slurmctld.out.log"))
        for node in slurm.nodes:  # several slurmd on one host: Debian builds --enable-multiple-slurmd
            slurm.procs.append(
                _start([_need("slurmd"), "-D", "-f", str(conf), "-N", node], directory / f"slurmd.{node}.out.log")
            )
        _wait_idle(slurm)
    except BaseException:
        slurm.stop()
        raise
    return slurm


@contextmanager
def local_slurm(directory: Path, nodes: Sequence[str] = SLURM_NODES) -> Iterator[LocalSlurm]:
    slurm = start_slurm(directory, nodes)
    try:
        yield slurm
    finally:
        slurm.stop()


def _start_munged(slurm: LocalSlurm) -> None:
    d = slurm.directory
    key = d / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    # --force: munged refuses to run as root without it
    slurm.procs.append(
        _start(
            [
                _need("munged"),
                "--foreground",
                "--force",
                f"--socket={d / 'munge.sock'}",
                f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}",
                f"--seed-file={d / 'munged.seed'}",
                f"--log-file={d / 'munged.log'}",
            ],
            d / "munged.out.log",
        )
    )
    _wait_for(lambda: (d / "munge.sock").exists(), "munged's socket", slurm)


def _slurm_conf(directory: Path, nodes: tuple[str, ...]) -> Path:
    host = socket.gethostname()
    ctld_port, *node_ports = [free_port() for _ in range(1 + len(nodes))]  # distinct: free_port never repeats one
    node_lines = "".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.{i + 1} Port={p} CPUs=1 State=UNKNOWN\n"
        for i, (n, p) in enumerate(zip(nodes, node_ports))
    )
    # Note [Slurm without cgroups]: proctrack/linuxproc and task/none need no cgroup hierarchy (a
    # container has none to give); no accounting daemon, no mail.
    path = directory / "slurm.conf"
    path.write_text(
        f"ClusterName=zerospeed-test\nSlurmctldHost={host}(127.0.0.1)\nSlurmUser={getpass.getuser()}\n"
        f"SlurmctldPort={ctld_port}\nSlurmdPort={node_ports[0]}\n"
        f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={directory / 'munge.sock'}\n"
        f"StateSaveLocation={directory / 'state'}\nSlurmdSpoolDir={directory / 'spool'}/%n\n"
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}\nSlurmdPidFile={directory / 'slurmd'}.%n.pid\n"
        f"SlurmctldLogFile={directory / 'slurmctld.log'}\nSlurmdLogFile={directory / 'slurmd'}.%n.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/none\nMpiDefault=none\nMailProg=/bin/true\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/builtin\n"
        "ReturnToService=2\n"
        f"{node_lines}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
    )
    for name in ("state", "spool"):
        (directory / name).mkdir(exist_ok=True)
    return path


def _wait_idle(slurm: LocalSlurm) -> None:
    sinfo = [_need("sinfo"), "--noheader", "--format=%T", "--nodes", ",".join(slurm.nodes)]

    def idle() -> bool:
        result = subprocess.run(
            sinfo, check=False, env={**os.environ, **slurm.env}, capture_output=True, text=True, timeout=10
        )
        return result.returncode == 0 and result.stdout.split() == ["idle"]  # one line per state

    _wait_for(idle, f"slurm nodes {', '.join(slurm.nodes)} idle", slurm)


def _wait_for(ready, what: str, slurm: LocalSlurm) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        dead = [p.args[0] for p in slurm.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"not within {START_TIMEOUT_S} s"
            raise DaemonError(f"waiting for {what}: {why}\n{slurm.logs()}")
        time.sleep(0.1)


# ----------------------------------------------------------------------------------- job processes


def write_hostfile(path: Path, hosts: Sequence[str] = NODE_ADDRS, slots: int = 1) -> Path:
    path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
    return path


def job_processes(marker: str, daemons: Sequence[int] = ()) -> list[psutil.Process]:
    """Live processes of the job tagged ``JOB_VAR=marker``, and everything the daemons (pids) started."""
    found = {p.pid: p for p in _descendants(daemons)}
    me = os.getpid()
    for p in psutil.process_iter():
        try:
            if p.pid != me and p.environ().get(JOB_VAR) == marker:
                found[p.pid] = p
        except psutil.Error:
            pass  # gone meanwhile, or not ours to read
    return [p for p in found.values() if _is_running(p)]


def leftover_processes(marker: str, daemons: Sequence[int] = (), *, wait_s: float = 5.0) -> list[str]:
    """``job_processes`` still alive after up to ``wait_s``, each described with its node."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = job_processes(marker, daemons)
        if not alive or time.monotonic() > deadline:
            return [_describe(p) for p in alive]
        time.sleep(0.1)


def kill_job(marker: str, daemons: Sequence[int] = ()) -> None:
    """Kill what ``job_processes`` finds, so that one failing test does not poison the next."""
    _kill_all(job_processes(marker, daemons))


def _describe(p: psutil.Process) -> str:
    try:
        env = p.environ()
        connection = env.get("SSH_CONNECTION", "").split()
        node = (
            connection[2]
            if len(connection) == 4
            else env.get("SLURMD_NODENAME") or "this machine (not through a daemon)"
        )
        return f"pid {p.pid} on node {node}: {' '.join(p.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {p.pid} (gone while listed)"


# ------------------------------------------------------------------------------------------ helpers


def _need(program: str) -> str:
    path = which(program)
    if path is None:
        raise DaemonError(f"{program} is not installed (scripts/install_daemons.sh installs {PACKAGES[program]})")
    return path


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} missing)"


def _ensure_dir(path: str, who: str) -> None:
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as err:
        raise DaemonError(f"{who} needs {path}, which cannot be made: {err}") from err


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _descendants(pids: Sequence[int]) -> list[psutil.Process]:
    below = []
    for pid in pids:
        try:
            below += psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return below


def _with_descendants(pids: Sequence[int]) -> list[psutil.Process]:
    """``pids`` (those alive) and all their descendants."""
    roots = []
    for pid in pids:
        try:
            roots.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return roots + _descendants(pids)


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_all(procs: Sequence[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)
