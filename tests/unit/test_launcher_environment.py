"""Rank arithmetic, the per-rank environment and argv, and the world encoding."""

import base64

import pytest

from zerospeed.launcher.environment import UserCommand, omp_num_threads, rank_argv, rank_environment
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.world import NodeLayout, decode_world_info, encode_world_info, node_layout, uniform_world


def test_layout_one_node_of_two():
    layout = node_layout({"localhost": [0, 1]}, 0)
    assert layout == NodeLayout(node_rank=0, num_nodes=1, world_size=2, first_rank=0, slots=(0, 1))
    assert layout.local_size == 2
    assert [layout.global_rank(i) for i in range(2)] == [0, 1]


def test_layout_second_of_two_nodes_of_two():
    layout = node_layout({"w0": [0, 1], "w1": [0, 1]}, 1)
    assert layout == NodeLayout(node_rank=1, num_nodes=2, world_size=4, first_rank=2, slots=(0, 1))
    assert [layout.global_rank(i) for i in range(2)] == [2, 3]


def test_layout_uneven_nodes_counts_slots_of_earlier_nodes():
    world = {"a": [0, 1, 2], "b": [5], "c": [1, 3]}
    assert node_layout(world, 1) == NodeLayout(1, 3, 6, 3, (5,))
    assert node_layout(world, 2) == NodeLayout(2, 3, 6, 4, (1, 3))


@pytest.mark.parametrize("node_rank", [-1, 2])
def test_layout_node_rank_out_of_range(node_rank):
    with pytest.raises(LauncherError) as info:
        node_layout({"a": [0], "b": [0]}, node_rank)
    assert str(info.value) == f"node rank {node_rank} is outside 0..1 (the world has 2 node(s): a, b)"


def test_uniform_world():
    assert uniform_world(3, [0, 1]) == {"node-0": [0, 1], "node-1": [0, 1], "node-2": [0, 1]}


def test_world_info_encoding_is_urlsafe_base64_json():
    expected = base64.urlsafe_b64encode(b'{"w0": [0, 1], "w1": [2]}').decode()
    assert encode_world_info({"w0": [0, 1], "w1": (2,)}) == expected
    assert decode_world_info(expected) == {"w0": [0, 1], "w1": [2]}


def test_world_info_bad_values():
    with pytest.raises(LauncherError, match="^--world_info is not base64-encoded JSON: "):
        decode_world_info("!!not base64!!")
    not_a_world = base64.urlsafe_b64encode(b'{"w0": []}').decode()
    with pytest.raises(LauncherError) as info:
        decode_world_info(not_a_world)
    assert str(info.value) == "--world_info must encode a non-empty {host: [slot, ...]}, got {'w0': []}"


BASE = {"PATH": "/usr/bin", "HOME": "/root"}


def test_environment_one_node_two_ranks():
    layout = node_layout({"localhost": [0, 1]}, 0)
    envs = [
        rank_environment(layout, lr, master_addr="127.0.0.1", master_port=29500, cpu_count=8, base_env=BASE)
        for lr in range(2)
    ]
    common = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "4",  # 8 cores // 2 processes
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }  # torch's names too
    assert envs[0] == {**common, "RANK": "0", "LOCAL_RANK": "0"}
    assert envs[1] == {**common, "RANK": "1", "LOCAL_RANK": "1"}


def test_environment_node_rank_one_of_two_nodes_of_two():
    layout = node_layout({"w0": [0, 1], "w1": [2, 3]}, 1)
    envs = [
        rank_environment(layout, lr, master_addr="10.1.2.3", master_port=6000, cpu_count=2, base_env={})
        for lr in range(2)
    ]
    common = {
        "WORLD_SIZE": "4",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "2",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "6000",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "OMP_NUM_THREADS": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
    }
    assert envs[0] == {**common, "RANK": "2", "LOCAL_RANK": "0"}
    assert envs[1] == {**common, "RANK": "3", "LOCAL_RANK": "1"}


def test_environment_overrides_stale_launch_variables():
    layout = node_layout({"localhost": [0]}, 0)
    env = rank_environment(
        layout,
        0,
        master_addr="h",
        master_port=1,
        cpu_count=1,
        base_env={"RANK": "7", "WORLD_SIZE": "9", "CUDA_VISIBLE_DEVICES": "3"},
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "1", "0")


def test_user_omp_num_threads_is_kept():
    layout = node_layout({"localhost": [0, 1]}, 0)
    env = rank_environment(layout, 0, master_addr="h", master_port=1, cpu_count=64, base_env={"OMP_NUM_THREADS": "6"})
    assert env["OMP_NUM_THREADS"] == "6"


@pytest.mark.parametrize("cpus, procs, expected", [(2, 2, 1), (8, 2, 4), (7, 2, 3), (1, 4, 1), (2, 3, 1), (16, 1, 16)])
def test_omp_num_threads(cpus, procs, expected):
    assert omp_num_threads(cpus, procs) == expected


PY = "/usr/bin/python3"


def test_argv_default():
    cmd = UserCommand("train.py", ("--deepspeed", "ds_config.json"))
    assert rank_argv(cmd, 1, PY) == [PY, "-u", "train.py", "--local_rank=1", "--deepspeed", "ds_config.json"]


def test_argv_module():
    cmd = UserCommand("pkg.train", ("--x",), module=True)
    assert rank_argv(cmd, 0, PY) == [PY, "-u", "-m", "pkg.train", "--local_rank=0", "--x"]


def test_argv_no_python():
    cmd = UserCommand("./run.sh", ("a",), no_python=True)
    assert rank_argv(cmd, 2, PY) == ["./run.sh", "--local_rank=2", "a"]


def test_argv_no_local_rank():
    cmd = UserCommand("train.py", ("a",), no_local_rank=True)
    assert rank_argv(cmd, 3, PY) == [PY, "-u", "train.py", "a"]


def test_argv_args_with_quotes_and_spaces_are_verbatim():
    args = ("--name", "my run", 'say "hi"', "it's", "--local_rank=9", "", "$HOME")
    assert rank_argv(UserCommand("t.py", args), 0, PY) == [PY, "-u", "t.py", "--local_rank=0", *args]


def test_module_and_no_python_conflict():
    with pytest.raises(LauncherError) as info:
        UserCommand("x", module=True, no_python=True)
    assert str(info.value) == "--module and --no_python cannot be used together: a module needs python"
