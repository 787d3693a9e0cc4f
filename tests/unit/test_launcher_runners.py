"""Exact command lines of the multi-node runners."""
import pytest

from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.runners import (NodeCommand, check_runner_world, collect_exports, hydra_command,
                                        local_commands, node_launcher_argv, openmpi_command, parse_env_file,
                                        pdsh_command, pdsh_kill_command, remote_shell_command, slurm_command,
                                        ssh_commands)

PY = "/usr/bin/python3"
NC = NodeCommand(world_info="eyJ3MCI6IFswXX0=", master_addr="10.0.0.1", master_port=29500,
                 command=UserCommand("train.py", ("--deepspeed", "ds config.json")), python=PY)
NODE = [PY, "-u", "-m", "zerospeed.launcher.node", "--world_info=eyJ3MCI6IFswXX0="]
TAIL = ["--master_addr=10.0.0.1", "--master_port=29500", "--", "train.py", "--deepspeed", "ds config.json"]
FROM_ENV = [*NODE, "--node_rank_from_env", *TAIL]
HOSTS = ["w0", "w1"]


def test_node_launcher_argv_plain():
    assert node_launcher_argv(NC, 3) == [*NODE, "--node_rank=3", *TAIL]
    assert node_launcher_argv(NC, None) == FROM_ENV


def test_node_launcher_argv_all_options():
    nc = NodeCommand("WI", "h", 1234, UserCommand("pkg.train", ("x",), module=True, no_local_rank=True),
                     each_rank_log="/logs", save_pid=77, python=PY)
    assert node_launcher_argv(nc, "%n", watch_stdin=True) == [
        PY, "-u", "-m", "zerospeed.launcher.node", "--world_info=WI", "--node_rank=%n", "--master_addr=h",
        "--master_port=1234", "--module", "--no_local_rank", "--watch_stdin", "--enable_each_rank_log=/logs",
        "--save_pid=77", "--", "pkg.train", "x"]


def test_node_launcher_argv_no_python():
    nc = NodeCommand("WI", "h", 1, UserCommand("./run.sh", no_python=True), python=PY)
    assert node_launcher_argv(nc, 0)[-4:] == ["--master_port=1", "--no_python", "--", "./run.sh"]


EXPORTS = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/my code:/lib"}
REMOTE_0 = ("export NCCL_DEBUG=INFO; export PYTHONPATH='/my code:/lib'; cd /work/job; "
            f"{PY} -u -m zerospeed.launcher.node --world_info=eyJ3MCI6IFswXX0= --node_rank=NR "
            "--master_addr=10.0.0.1 --master_port=29500 -- train.py --deepspeed 'ds config.json'")


def test_remote_shell_command_quotes_every_word():
    line = remote_shell_command({"A": "x y", "B": "it's"}, "/a b", ["prog", "a b", 'say "hi"', "$HOME", ""])
    assert line == ("export A='x y'; export B='it'\"'\"'s'; cd '/a b'; "
                    "prog 'a b' 'say \"hi\"' '$HOME' ''")


def test_pdsh_command():
    cmd = pdsh_command(HOSTS, NC, exports=EXPORTS, cwd="/work/job", launcher_args=["-R", "ssh"])
    assert cmd == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh", REMOTE_0.replace("NR", "%n")]


def test_pdsh_kill_command():
    assert pdsh_kill_command(HOSTS, NC) == [
        "pdsh", "-S", "-f", "1024", "-w", "w0,w1",
        r"pkill -f -- '[z]erospeed\.launcher\.node --world_info=eyJ3MCI6IFswXX0= .*--master_port=29500 '"]


def test_ssh_commands_one_per_host_with_its_rank():
    cmds = ssh_commands(HOSTS, NC, exports=EXPORTS, cwd="/work/job", ssh_port=2222, launcher_args=["-o", "X=1"])
    line = REMOTE_0.replace("--master_port=29500 --", "--master_port=29500 --watch_stdin --")
    assert cmds == [["ssh", "-p", "2222", "-o", "X=1", "w0", line.replace("NR", "0")],
                    ["ssh", "-p", "2222", "-o", "X=1", "w1", line.replace("NR", "1")]]


def test_ssh_commands_default_port():
    assert ssh_commands(["w0"], NC, exports={}, cwd="/")[0][:2] == ["ssh", "w0"]


def test_openmpi_command():
    assert openmpi_command(HOSTS, NC, exports={"NCCL_DEBUG": "INFO"}, launcher_args=["--mca", "x", "y"]) == [
        "mpirun", "--allow-run-as-root", "-np", "2", "-H", "w0,w1", "--map-by", "ppr:1:node", "--bind-to", "none",
        "--mca", "x", "y", "-x", "NCCL_DEBUG=INFO", *FROM_ENV]


def test_hydra_command():
    assert hydra_command(["a", "b", "c"], NC, exports={"MV2_ENABLE_AFFINITY": "0", "K": "v w"}) == [
        "mpirun", "-n", "3", "-ppn", "1", "-hosts", "a,b,c", "-genv", "MV2_ENABLE_AFFINITY", "0",
        "-genv", "K", "v w", *FROM_ENV]


def test_slurm_command():
    assert slurm_command(HOSTS, NC, exports={"NCCL_DEBUG": "INFO", "A": "1"}, launcher_args=["--exclusive"],
                         comment="run 7", account="proj") == [
        "srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--nodelist", "w0,w1", "--exclusive",
        "--comment", "run 7", "--account", "proj", "--export=ALL,NCCL_DEBUG=INFO,A=1", *FROM_ENV]


def test_slurm_command_minimal():
    assert slurm_command(["w0"], NC, exports={}) == [
        "srun", "--nodes", "1", "--ntasks", "1", "--ntasks-per-node", "1", "--nodelist", "w0", "--export=ALL",
        *FROM_ENV]


def test_local_commands():
    assert local_commands(["localhost", "127.0.0.1"], NC) == [[*NODE, "--node_rank=0", *TAIL],
                                                              [*NODE, "--node_rank=1", *TAIL]]


def test_collect_exports():
    env = {"NCCL_DEBUG": "INFO", "HOME": "/root", "PYTHONPATH": "/x", "UCX_TLS": "tcp", "MYNCCL": "no",
           "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert collect_exports(env, {"FROM_FILE": "1", "UCX_TLS": "rc"}) == {
        "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "UCX_TLS": "rc", "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "FROM_FILE": "1"}


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
    assert str(info.value) == ("--launcher slurm needs the same slots on every node, got a:0,1, b:0; "
                               "use --launcher pdsh or ssh for uneven nodes")
