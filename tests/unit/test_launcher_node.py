"""The per-node launcher's pure parts: what it starts for each rank, its node index, its pid file."""
import os

import pytest

from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.local import ChildSpec
from zerospeed.launcher.node import NodeOptions, node_rank_from_env, rank_specs
from zerospeed.launcher.pidfile import pid_file_path, saved_pid

PY = "/usr/bin/python3"
WORLD = {"w0": [0, 1], "w1": [2, 3]}


def test_rank_specs_second_node():
    specs = rank_specs(WORLD, 1, UserCommand("t.py", ("a b",)), NodeOptions("10.0.0.1", 29501),
                       base_env={"PATH": "/bin"}, cpu_count=4, python=PY)
    common = {"PATH": "/bin", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501", "CUDA_VISIBLE_DEVICES": "2,3",
              "OMP_NUM_THREADS": "2"}
    assert specs == [
        ChildSpec("rank 2", [PY, "-u", "t.py", "--local_rank=0", "a b"], {**common, "RANK": "2", "LOCAL_RANK": "0"}),
        ChildSpec("rank 3", [PY, "-u", "t.py", "--local_rank=1", "a b"], {**common, "RANK": "3", "LOCAL_RANK": "1"}),
    ]


def test_rank_specs_logs_and_stdin():
    options = NodeOptions("h", 1, each_rank_log="/logs", watch_stdin=True)
    specs = rank_specs(WORLD, 0, UserCommand("t.py"), options, base_env={}, cpu_count=1,
                       log_prefix="20240102030405", python=PY)
    assert [(s.log_path, s.stdin) for s in specs] == [("/logs/20240102030405_rank0.log", "devnull"),
                                                      ("/logs/20240102030405_rank1.log", "devnull")]


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "0"}, 1),
    ({"PMI_RANK": "2"}, 2),
    ({"PMIX_RANK": "3"}, 3),
    ({"MV2_COMM_WORLD_RANK": "4"}, 4),
    ({"SLURM_PROCID": "5"}, 5),
])
def test_node_rank_from_env(env, expected):
    assert node_rank_from_env(env) == expected


def test_node_rank_from_env_missing_or_bad():
    with pytest.raises(LauncherError) as info:
        node_rank_from_env({})
    assert str(info.value) == ("--node_rank_from_env: none of OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK, "
                               "MV2_COMM_WORLD_RANK, SLURM_PROCID is set; this process was not started by "
                               "mpirun or srun")
    with pytest.raises(LauncherError, match="SLURM_PROCID='x' is not a node index"):
        node_rank_from_env({"SLURM_PROCID": "x"})


def test_saved_pid_writes_and_removes(tmp_path, capsys):
    path = tmp_path / "123.deepspeed"
    with saved_pid(123, str(tmp_path)):
        assert path.read_text() == str(os.getpid())
    assert not path.exists()
    assert capsys.readouterr().out == f"launcher pid: {os.getpid()}\n"


def test_saved_pid_removes_on_error(tmp_path):
    with pytest.raises(RuntimeError), saved_pid(5, str(tmp_path)):
        raise RuntimeError("boom")
    assert not (tmp_path / "5.deepspeed").exists()


def test_saved_pid_refuses_an_existing_file(tmp_path):
    (tmp_path / "9.deepspeed").write_text("1")
    with pytest.raises(LauncherError) as info, saved_pid(9, str(tmp_path)):
        pass
    assert str(info.value) == (f"--save_pid: {tmp_path}/9.deepspeed already exists; another launch with the "
                               "same main pid is running, or a stale file needs removing")
    assert (tmp_path / "9.deepspeed").read_text() == "1"


def test_saved_pid_none_does_nothing(tmp_path):
    with saved_pid(None, str(tmp_path)):
        pass
    assert list(tmp_path.iterdir()) == []
    assert pid_file_path(1, str(tmp_path)) == f"{tmp_path}/1.deepspeed"
