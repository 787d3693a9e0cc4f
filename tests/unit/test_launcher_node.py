"""The per-node launcher's pure parts: what it asks of each rank, its node index, its pid file."""

import os

import pytest

from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.node import NodeOptions, _parser, agent_job, node_rank_from_env, worker_spec
from zerospeed.launcher.pidfile import pid_file_path, saved_pid

WORLD = {"w0": [0, 1], "w1": [2, 3]}


def test_worker_spec_second_node():
    spec = worker_spec(
        WORLD,
        1,
        UserCommand("t.py", ("a b", "$$", "${local_rank}")),
        NodeOptions("10.0.0.1", 29501),
        base_env={"PATH": "/bin"},
        cpu_count=4,
    )
    assert spec == {
        "argv": [
            ["t.py", "--local_rank=0", "a b", "$$", "${local_rank}"],
            ["t.py", "--local_rank=1", "a b", "$$", "${local_rank}"],
        ],
        "mode": "script",
        "env": {"CUDA_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": "2"},
        "cores": None,
        "log_dir": None,
        "log_prefix": "",
        "stdin_devnull": False,
    }


def test_worker_spec_modes_logs_and_stdin():
    options = NodeOptions("h", 1, each_rank_log="/logs", watch_stdin=True)
    spec = worker_spec(
        WORLD,
        0,
        UserCommand("pkg.m", module=True, no_local_rank=True),
        options,
        base_env={"OMP_NUM_THREADS": "3"},
        cpu_count=1,
        log_prefix="20240102030405",
    )
    assert (spec["argv"], spec["mode"], spec["env"]) == (
        [["pkg.m"], ["pkg.m"]],
        "module",
        {"CUDA_VISIBLE_DEVICES": "0,1"},
    )  # user's OMP kept
    assert (spec["log_dir"], spec["log_prefix"], spec["stdin_devnull"]) == ("/logs", "20240102030405", True)
    exe = worker_spec(WORLD, 0, UserCommand("./run.sh", no_python=True), options, base_env={}, cpu_count=1)
    assert (exe["argv"][1], exe["mode"]) == (["./run.sh", "--local_rank=1"], "exec")


def _job(options, world=WORLD, node_rank=1, env=None, command=UserCommand("t.py")):
    return agent_job(
        world, node_rank, command, options, base_env=env or {}, cpu_count=2, log_prefix="p", name="zerospeed node 1"
    )


def test_agent_job_fixed_world():
    job = _job(NodeOptions("10.0.0.1", 29501, max_restarts=2))
    plan = job.plan
    assert (plan.endpoint, plan.min_nodes, plan.max_nodes, plan.node_rank, plan.num_nodes) == (
        "10.0.0.1:29501",
        2,
        2,
        1,
        2,
    )
    assert (plan.is_host, plan.pinned, plan.run_id, plan.join_timeout_s, plan.last_call_timeout_s) == (
        False,
        True,
        "zerospeed",
        600,
        30,
    )
    assert (job.local_world_size, job.max_restarts, plan.master_addr, plan.master_port) == (2, 2, "10.0.0.1", 29501)


def test_agent_job_elastic_defaults_are_deepspeeds():
    plan = _job(NodeOptions("h", 1, elastic_training=True), node_rank=0).plan
    assert (plan.min_nodes, plan.max_nodes, plan.is_host, plan.pinned) == (1, 2, True, False)
    plan = _job(NodeOptions("h", 1, elastic_training=True, min_elastic_nodes=2, max_elastic_nodes=4)).plan
    assert (plan.min_nodes, plan.max_nodes) == (2, 4)


@pytest.mark.parametrize(
    "options, env, message",
    [
        (NodeOptions("h", 1, max_restarts=-1), {}, "--max_restarts must be >= 0, got -1"),
        (
            NodeOptions("h", 1, elastic_training=True, min_elastic_nodes=3, max_elastic_nodes=2),
            {},
            "--min_elastic_nodes 3 / --max_elastic_nodes 2: need 1 <= min <= max",
        ),
        (
            NodeOptions("h", 1),
            {"ZEROSPEED_RDZV_TIMEOUT": "soon"},
            "ZEROSPEED_RDZV_TIMEOUT='soon' must be a whole number of seconds >= 1",
        ),
    ],
)
def test_agent_job_errors(options, env, message):
    with pytest.raises(LauncherError) as info:
        _job(options, env=env)
    assert str(info.value) == message


def test_agent_job_elastic_needs_local_rank():
    with pytest.raises(LauncherError, match="--no_local_rank is not supported with --elastic_training"):
        _job(NodeOptions("h", 1, elastic_training=True), command=UserCommand("t.py", no_local_rank=True))


def test_agent_job_timeouts_from_the_environment():
    plan = _job(
        NodeOptions("h", 1),
        env={
            "ZEROSPEED_RDZV_TIMEOUT": "7",
            "ZEROSPEED_RDZV_LAST_CALL_TIMEOUT": "2",
            "ZEROSPEED_RDZV_KEEP_ALIVE_INTERVAL": "1",
            "ZEROSPEED_RUN_ID": "job9",
        },
    ).plan
    assert (plan.join_timeout_s, plan.last_call_timeout_s, plan.keep_alive_s, plan.run_id) == (7, 2, 1, "job9")
    assert plan.parameters() == {
        "backend": "c10d",
        "endpoint": "h:1",
        "run_id": "job9",
        "min_nodes": 2,
        "max_nodes": 2,
        "is_host": False,
        "join_timeout": 7,
        "last_call_timeout": 2,
        "keep_alive_interval": 1,
        "read_timeout": 7,
    }
    assert _job(NodeOptions("h", 1)).plan.keep_alive_s == 5  # torch's default


def test_node_launcher_parses_the_agent_flags_runners_send():
    from zerospeed.launcher.runners import NodeCommand, node_launcher_argv

    nc = NodeCommand(
        "e30=",
        "10.0.0.1",
        29500,
        UserCommand("t.py", ("--max_restarts=9",)),
        max_restarts=3,
        elastic_training=True,
        min_elastic_nodes=1,
        max_elastic_nodes=4,
    )
    argv = node_launcher_argv(nc, 1)
    cut = argv.index("--")
    assert argv[cut - 4 :] == [
        "--max_restarts=3",
        "--elastic_training",
        "--min_elastic_nodes=1",
        "--max_elastic_nodes=4",
        "--",
        "t.py",
        "--max_restarts=9",
    ]
    args = _parser().parse_args(argv[argv.index("-m") + 2 : cut])
    assert (args.max_restarts, args.elastic_training, args.min_elastic_nodes, args.max_elastic_nodes) == (3, True, 1, 4)
    plain = node_launcher_argv(NodeCommand("e30=", "h", 1, UserCommand("t.py")), 0)
    assert not any(w.startswith(("--max_restarts", "--elastic", "--min_elastic", "--max_elastic")) for w in plain)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "0"}, 1),
        ({"PMI_RANK": "2"}, 2),
        ({"PMIX_RANK": "3"}, 3),
        ({"MV2_COMM_WORLD_RANK": "4"}, 4),
        ({"SLURM_PROCID": "5"}, 5),
    ],
)
def test_node_rank_from_env(env, expected):
    assert node_rank_from_env(env) == expected


def test_node_rank_from_env_missing_or_bad():
    with pytest.raises(LauncherError) as info:
        node_rank_from_env({})
    assert str(info.value) == (
        "--node_rank_from_env: none of OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK, "
        "MV2_COMM_WORLD_RANK, SLURM_PROCID is set; this process was not started by "
        "mpirun or srun"
    )
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
    assert str(info.value) == (
        f"--save_pid: {tmp_path}/9.deepspeed already exists; another launch with the "
        "same main pid is running, or a stale file needs removing"
    )
    assert (tmp_path / "9.deepspeed").read_text() == "1"


def test_saved_pid_none_does_nothing(tmp_path):
    with saved_pid(None, str(tmp_path)):
        pass
    assert list(tmp_path.iterdir()) == []
    assert pid_file_path(1, str(tmp_path)) == f"{tmp_path}/1.deepspeed"
