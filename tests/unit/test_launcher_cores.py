"""Core binding arithmetic (DeepSpeed's --bind_cores_to_rank / --bind_core_list rules), hand-worked."""

import pytest

from zerospeed.launcher.cores import cores_for_rank, parse_core_list
from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.node import NodeOptions, worker_spec


def test_parse_core_list():
    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert parse_core_list("5") == [5]
    assert parse_core_list("0-3,8-9") == [0, 1, 2, 3, 8, 9]
    for bad in ("3-1", "a", "1-2-3", "0,0", "2-4,3", "4,1"):
        with pytest.raises(LauncherError, match="--bind_core_list"):
            parse_core_list(bad)


def test_cores_split_into_equal_consecutive_blocks():
    cores = [0, 2, 3, 4, 6, 7, 9]
    assert [cores_for_rank(cores, 3, r) for r in range(3)] == [[0, 2], [3, 4], [6, 7]]  # 9 is left over
    assert [cores_for_rank(cores, 7, r) for r in range(7)] == [[c] for c in cores]
    with pytest.raises(LauncherError, match="cannot give each of 8 local ranks a core"):
        cores_for_rank(cores, 8, 0)


def test_worker_spec_binds_and_sets_omp_num_threads():
    options = NodeOptions("127.0.0.1", 29500, bind_cores_to_rank=True, bind_core_list="0-5")
    spec = worker_spec(
        {"localhost": [0, 1, 2]}, 0, UserCommand("t.py"), options, base_env={"OMP_NUM_THREADS": "9"}, cpu_count=6
    )
    assert spec["cores"] == [[0, 1], [2, 3], [4, 5]]
    assert spec["env"]["OMP_NUM_THREADS"] == "2"  # the block's size, over the user's 9 (DeepSpeed's rule)
    unbound = worker_spec(
        {"localhost": [0, 1]}, 0, UserCommand("t.py"), NodeOptions("127.0.0.1", 29500), base_env={}, cpu_count=6
    )
    assert unbound["cores"] is None
    with pytest.raises(LauncherError, match="KMP_AFFINITY"):
        worker_spec({"localhost": [0]}, 0, UserCommand("t.py"), options, base_env={"KMP_AFFINITY": "x"}, cpu_count=6)


def test_node_launchers_are_told_to_bind():
    from zerospeed.launcher.node import _parser
    from zerospeed.launcher.runners import NodeCommand, node_launcher_argv

    nc = NodeCommand("e30=", "10.0.0.1", 29500, UserCommand("t.py"), bind_cores_to_rank=True, bind_core_list="0-7")
    argv = node_launcher_argv(nc, 1)
    assert "--bind_cores_to_rank" in argv and "--bind_core_list=0-7" in argv
    args = _parser().parse_args(argv[argv.index("-m") + 2 : argv.index("--")])
    assert args.bind_cores_to_rank and args.bind_core_list == "0-7"
