"""Exact command lines of the multi-node runners."""

import pytest

from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.runners import (
    NodeCommand,
    check_runner_world,
    collect_exports,
    hydra_command,
    local_commands,
    node_launcher_argv,
    openmpi_command,
    parse_env_file,
    pdsh_commands,
    pdsh_kill_command,
    remote_shell_command,
    slurm_command,
    slurm_env,
    ssh_commands,
    ssh_kill_commands,
    with_rsh_port,
)

PY = "/usr/bin/python3"
NC = NodeCommand(
    world_info="eyJ3MCI6IFswXX0=",
    master_addr="10.0.0.1",
    master_port=29500,
    command=UserCommand("train.py", ("--deepspeed", "ds config.json")),
    python=PY,
)
NODE = [PY, "-u", "-m", "zerospeed.launcher.node", "--world_info=eyJ3MCI6IFswXX0="]
TAIL = ["--master_addr=10.0.0.1", "--master_port=29500", "--", "train.py", "--deepspeed", "ds config.json"]
FROM_ENV = [*NODE, "--node_rank_from_env", *TAIL]
HOSTS = ["w0", "w1"]


def test_node_launcher_argv_plain():
    assert node_launcher_argv(NC, 3) == [*NODE, "--node_rank=3", *TAIL]
    assert node_launcher_argv(NC, None) == FROM_ENV


def test_node_launcher_argv_all_options():
    nc = NodeCommand(
        "WI",
        "h",
        1234,
        UserCommand("pkg.train", ("x",), module=True, no_local_rank=True),
        each_rank_log="/logs",
        save_pid=77,
        python=PY,
    )
    assert node_launcher_argv(nc, "%n", watch_stdin=True) == [
        PY,
        "-u",
        "-m",
        "zerospeed.launcher.node",
        "--world_info=WI",
        "--node_rank=%n",
        "--master_addr=h",
        "--master_port=1234",
        "--module",
        "--no_local_rank",
        "--watch_stdin",
        "--enable_each_rank_log=/logs",
        "--save_pid=77",
        "--",
        "pkg.train",
        "x",
    ]


def test_node_launcher_argv_no_python():
    nc = NodeCommand("WI", "h", 1, UserCommand("./run.sh", no_python=True), python=PY)
    assert node_launcher_argv(nc, 0)[-4:] == ["--master_port=1", "--no_python", "--", "./run.sh"]


EXPORTS = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/my code:/lib"}
REMOTE_0 = (
    "export NCCL_DEBUG=INFO; export PYTHONPATH='/my code:/lib'; cd /work/job; "
    f"{PY} -u -m zerospeed.launcher.node --world_info=eyJ3MCI6IFswXX0= --node_rank=NR "
    "--master_addr=10.0.0.1 --master_port=29500 -- train.py --deepspeed 'ds config.json'"
)


def test_remote_shell_command_quotes_every_word():
    line = remote_shell_command({"A": "x y", "B": "it's"}, "/a b", ["prog", "a b", 'say "hi"', "$HOME", ""])
    assert line == ("export A='x y'; export B='it'\"'\"'s'; cd '/a b'; prog 'a b' 'say \"hi\"' '$HOME' ''")


def test_pdsh_commands_one_per_host_with_its_rank():
    cmds = pdsh_commands(HOSTS, NC, exports=EXPORTS, cwd="/work/job", launcher_args=["-R", "ssh"])
    assert cmds == [
        ["pdsh", "-S", "-f", "1024", "-w", "w0", "-R", "ssh", REMOTE_0.replace("NR", "0")],
        ["pdsh", "-S", "-f", "1024", "-w", "w1", "-R", "ssh", REMOTE_0.replace("NR", "1")],
    ]


KILL_PATTERN = r"'[z]erospeed\.launcher\.node --world_info=eyJ3MCI6IFswXX0= .*--master_port=29500 '"
KILL_LINE = (
    f"pkill -f -- {KILL_PATTERN}; n=0; while [ $n -lt 25 ] && pgrep -f -- {KILL_PATTERN} >/dev/null; "
    f"do sleep 0.2; n=$((n + 1)); done; pkill -KILL -f -- {KILL_PATTERN}; true"
)


def test_pdsh_kill_command_terms_then_kills_after_the_grace():
    assert pdsh_kill_command(HOSTS, NC, ["-R", "ssh"], grace_s=5.0) == [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "w0,w1",
        "-R",
        "ssh",
        KILL_LINE,
    ]


def test_ssh_kill_commands_one_per_host():
    assert ssh_kill_commands(HOSTS, NC, ssh_port=2222, launcher_args=["-o", "X=1"], grace_s=5.0) == [
        ["ssh", "-n", "-p", "2222", "-o", "X=1", "w0", KILL_LINE],
        ["ssh", "-n", "-p", "2222", "-o", "X=1", "w1", KILL_LINE],
    ]


def test_ssh_commands_one_per_host_with_its_rank():
    cmds = ssh_commands(HOSTS, NC, exports=EXPORTS, cwd="/work/job", ssh_port=2222, launcher_args=["-o", "X=1"])
    line = REMOTE_0.replace("--master_port=29500 --", "--master_port=29500 --watch_stdin --")
    assert cmds == [
        ["ssh", "-p", "2222", "-o", "X=1", "w0", line.replace("NR", "0")],
        ["ssh", "-p", "2222", "-o", "X=1", "w1", line.replace("NR", "1")],
    ]


def test_ssh_commands_default_port():
    assert ssh_commands(["w0"], NC, exports={}, cwd="/")[0][:2] == ["ssh", "w0"]


def test_openmpi_command():
    assert openmpi_command(HOSTS, NC, exports={"NCCL_DEBUG": "INFO"}, launcher_args=["--mca", "x", "y"]) == [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        "2",
        "-H",
        "w0,w1",
        "--map-by",
        "ppr:1:node",
        "--bind-to",
        "none",
        "--mca",
        "x",
        "y",
        "-x",
        "NCCL_DEBUG=INFO",
        *FROM_ENV,
    ]


def test_openmpi_ssh_port_goes_into_the_rsh_agent_args():
    assert with_rsh_port(["-v"], None) == ["-v"]
    assert with_rsh_port(["-v"], 2222) == ["--mca", "plm_rsh_args", "-p 2222", "-v"]
    assert with_rsh_port([], 2222, inherited="-i key") == ["--mca", "plm_rsh_args", "-i key -p 2222"]
    assert with_rsh_port(["-mca", "plm_rsh_args", "-F cfg", "-v"], 2222, inherited="-i key") == [
        "-mca",
        "plm_rsh_args",
        "-F cfg -p 2222",
        "-v",
    ]
    cmd = openmpi_command(HOSTS, NC, exports={}, launcher_args=["--mca", "plm_rsh_args", "-F cfg"], ssh_port=2)
    assert cmd[10:13] == ["--mca", "plm_rsh_args", "-F cfg -p 2"]


def test_hydra_command():
    assert hydra_command(["a", "b", "c"], NC, exports={"MV2_ENABLE_AFFINITY": "0", "K": "v w"}) == [
        "mpirun",
        "-n",
        "3",
        "-ppn",
        "1",
        "-hosts",
        "a,b,c",
        "-genv",
        "MV2_ENABLE_AFFINITY",
        "0",
        "-genv",
        "K",
        "v w",
        *FROM_ENV,
    ]


def test_slurm_command():
    assert slurm_command(HOSTS, NC, launcher_args=["--exclusive"], comment="run 7", account="proj") == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        "--nodelist",
        "w0,w1",
        "--kill-on-bad-exit=1",
        "--exclusive",
        "--comment",
        "run 7",
        "--account",
        "proj",
        "--export=ALL",
        *FROM_ENV,
    ]


def test_slurm_command_minimal():
    assert slurm_command(["w0"], NC) == [
        "srun",
        "--nodes",
        "1",
        "--ntasks",
        "1",
        "--ntasks-per-node",
        "1",
        "--nodelist",
        "w0",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        *FROM_ENV,
    ]


def test_slurm_exports_travel_in_the_environment_commas_and_all():
    assert slurm_env({"PATH": "/bin", "A": "0"}, {"A": "1", "NCCL_SOCKET_IFNAME": "eth0,eth1"}) == {
        "PATH": "/bin",
        "A": "1",
        "NCCL_SOCKET_IFNAME": "eth0,eth1",
    }


def test_local_commands():
    assert local_commands(["localhost", "127.0.0.1"], NC) == [
        [*NODE, "--node_rank=0", *TAIL],
        [*NODE, "--node_rank=1", *TAIL],
    ]


def test_collect_exports():
    env = {
        "NCCL_DEBUG": "INFO",
        "HOME": "/root",
        "PYTHONPATH": "/x",
        "UCX_TLS": "tcp",
        "MYNCCL": "no",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    }
    assert collect_exports(env, {"FROM_FILE": "1", "UCX_TLS": "rc"}) == {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/x",
        "UCX_TLS": "rc",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "FROM_FILE": "1",
    }


def test_parse_env_file():
    text = "# exports\nNCCL_IB_DISABLE=1\n\n  HF_HOME = /data/hf \nX=a=b\n"
    assert parse_env_file(text, "~/.deepspeed_env") == {"NCCL_IB_DISABLE": "1", "HF_HOME": "/data/hf", "X": "a=b"}


def test_parse_env_file_bad_line():
    with pytest.raises(LauncherError) as info:
        parse_env_file("A=1\nNOVALUE\n", ".deepspeed_env")
    assert str(info.value) == ".deepspeed_env:2: bad line 'NOVALUE'; expected KEY=VALUE"


def test_slurm_needs_even_nodes():
    check_runner_world("slurm", {"a": [0, 1], "b": [0, 1]})
    check_runner_world("pdsh", {"a": [0, 1], "b": [0]})
    with pytest.raises(LauncherError) as info:
        check_runner_world("slurm", {"a": [0, 1], "b": [0]})
    assert str(info.value) == (
        "--launcher slurm needs the same slots on every node, got a:0,1, b:0; "
        "use --launcher pdsh or ssh for uneven nodes"
    )
