"""The command line: splitting launcher flags from the user command, flag errors, the launch plan."""

import pytest

from zerospeed.autotuning.command import TrialWorld
from zerospeed.launcher import cli
from zerospeed.launcher import hostfile as launcher_hostfile
from zerospeed.launcher.cli import main, parse_command_line, split_argv
from zerospeed.launcher.environment import UserCommand
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.plan import LaunchPlan, make_plan

VALUED = {"--num_gpus", "-H", "--hostfile", "--include"}


@pytest.mark.parametrize(
    "argv, ours, user",
    [
        (["--num_gpus", "2", "train.py", "--num_gpus", "3"], ["--num_gpus", "2"], ["train.py", "--num_gpus", "3"]),
        (["--num_gpus=2", "train.py"], ["--num_gpus=2"], ["train.py"]),
        (["--module", "pkg.main", "-m"], ["--module"], ["pkg.main", "-m"]),
        (["-H", "hf", "--include", "a:0", "t.py", "--", "x"], ["-H", "hf", "--include", "a:0"], ["t.py", "--", "x"]),
        (["--num_gpus", "2", "--", "-weird.py", "a"], ["--num_gpus", "2"], ["-weird.py", "a"]),
        (["train.py"], [], ["train.py"]),
        (["--num_gpus", "2"], ["--num_gpus", "2"], []),
        (["--bogus", "t.py"], ["--bogus"], ["t.py"]),
    ],
)
def test_split_argv(argv, ours, user):
    assert split_argv(argv, VALUED) == (ours, user)


def test_parse_deepspeed_style_line():
    args, command = parse_command_line(
        [
            "--num_gpus=8",
            "--num_nodes",
            "4",
            "--master_addr=HOST",
            "train.py",
            "--deepspeed",
            "ds_config.json",
            "--num_gpus",
            "1",
            "a 'b' \"c\"",
        ]
    )
    assert (args.num_gpus, args.num_nodes, args.master_addr, args.master_port) == (8, 4, "HOST", 29500)
    assert (args.hostfile, args.launcher, args.include, args.exclude, args.node_rank) == (None, "pdsh", "", "", None)
    assert command == UserCommand("train.py", ("--deepspeed", "ds_config.json", "--num_gpus", "1", "a 'b' \"c\""))


def test_parse_aliases_and_switches():
    args, command = parse_command_line(
        [
            "--num_accelerators",
            "2",
            "--module",
            "--no_local_rank",
            "--save_pid",
            "--force_multi",
            "--enable_each_rank_log",
            "/logs",
            "pkg.train",
        ]
    )
    assert (args.num_gpus, args.save_pid, args.force_multi, args.enable_each_rank_log) == (2, True, True, "/logs")
    assert command == UserCommand("pkg.train", (), module=True, no_local_rank=True)


def test_deepspeed_not_set_sentinels():
    args, _ = parse_command_line(["--num_gpus", "-1", "--num_nodes=-1", "--enable_each_rank_log", "None", "t.py"])
    assert (args.num_gpus, args.num_nodes, args.enable_each_rank_log) == (None, None, None)


@pytest.fixture
def no_gpu_probe(monkeypatch):
    # Keeps main() from importing torch to count devices: CUDA_VISIBLE_DEVICES names the slots.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_gpus", "2"], "missing the training script: zerospeed [options] user_script [user_args ...]"),
        (
            ["--module", "--no_python", "t.py"],
            "--module and --no_python cannot be used together: a module needs python",
        ),
        (
            ["--include", "localhost:0", "--exclude", "localhost:1", "t.py"],
            "--include and --exclude are mutually exclusive; use one of them",
        ),
        (
            ["--num_gpus", "1", "--include", "localhost:0", "t.py"],
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; select hosts and slots with one "
            "or the other",
        ),
        (["--include", "localhost:5", "t.py"], "--include names slot 5 on host 'localhost', whose slots are 0,1"),
        (["--num_gpus", "0", "t.py"], "--num_gpus must be >= 1, got 0"),
        (["--num_nodes", "-3", "t.py"], "--num_nodes must be >= 1, got -3"),
        (
            ["--launcher", "torchrun", "t.py"],
            "--launcher 'torchrun' is not one of pdsh, ssh, openmpi, mvapich, mpich, impi, slurm, local",
        ),
        (["--max_restarts", "-1", "t.py"], "--max_restarts must be >= 0, got -1"),
        (["--node_rank", "1", "t.py"], "--node_rank 1 needs --num_nodes > 1 (or a hostfile)"),
        (
            ["--num_nodes", "2", "--master_addr", "h", "t.py"],
            "--num_nodes 2 without a hostfile starts one node per invocation: run it on every node with --node_rank "
            "(0..N-1) and --master_addr of node 0, or give a --hostfile",
        ),
    ],
)
def test_flag_errors_exit_2_with_message(argv, message, no_gpu_probe, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"zerospeed: error: {message}\n"


def test_hostfile_errors_exit_2(tmp_path, capsys):
    path = tmp_path / "hf"
    path.write_text("w0 slots=2\nw0 slots=2\n")
    assert main(["--hostfile", str(path), "t.py"]) == 2
    assert capsys.readouterr().err == (
        f"zerospeed: error: {path}:2: host 'w0' is listed twice (first on line 1); "
        "list each host once with its total slot count\n"
    )


def test_unknown_flag_is_an_argparse_error(capsys):
    assert main(["--num_gpu", "2", "t.py"]) == 2  # no abbreviations: DeepSpeed's names only
    assert "zerospeed: error: unrecognized arguments: --num_gpu" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "usage: zerospeed [options] user_script [user_args ...]" in capsys.readouterr().out


def _flags(*argv):
    return parse_command_line([*argv, "t.py"])[0]


def _never() -> int:
    raise AssertionError("device_count must not be called")


def test_plan_single_node_num_gpus():
    assert make_plan(_flags("--num_gpus", "2"), None, "", _never) == LaunchPlan(
        {"localhost": [0, 1]}, 0, "127.0.0.1", "pdsh"
    )


def test_plan_single_node_all_gpus_or_one_cpu_process():
    assert make_plan(_flags(), None, "", lambda: 4).world == {"localhost": [0, 1, 2, 3]}
    assert make_plan(_flags(), None, "", lambda: 0).world == {"localhost": [0]}


def test_plan_single_node_include_exclude_on_visible_devices():
    assert make_plan(_flags("--exclude", "localhost:3"), None, "2,3,5", _never).world == {"localhost": [2, 5]}


def test_plan_torchrun_style_node():
    plan = make_plan(
        _flags("--num_gpus", "2", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"), None, "", _never
    )
    assert plan == LaunchPlan({"node-0": [0, 1], "node-1": [0, 1]}, 1, "10.0.0.1", "pdsh")


def test_plan_torchrun_style_node_rank_out_of_range():
    with pytest.raises(LauncherError) as info:
        make_plan(
            _flags("--num_nodes", "2", "--node_rank", "2", "--master_addr", "h", "--num_gpus", "1"), None, "", _never
        )
    assert str(info.value) == "--node_rank 2 is outside 0..1 for a job of 2 node(s)"


HOSTFILE = {"w0": 2, "w1": 2, "w2": 1}


def test_plan_hostfile_uses_the_runner_and_first_host_as_master():
    assert make_plan(_flags("--launcher", "SSH"), HOSTFILE, "", _never) == LaunchPlan(
        {"w0": [0, 1], "w1": [0, 1], "w2": [0]}, None, "w0", "ssh"
    )


def test_plan_hostfile_local_runner_masters_on_loopback():
    plan = make_plan(_flags("--launcher", "local", "--num_nodes", "2", "--num_gpus", "1"), HOSTFILE, "", _never)
    assert plan == LaunchPlan({"w0": [0], "w1": [0]}, None, "127.0.0.1", "local")


def test_plan_hostfile_include_and_master_addr():
    plan = make_plan(_flags("--include", "w1:1@w2", "--master_addr", "10.9.9.9"), HOSTFILE, "", _never)
    assert plan == LaunchPlan({"w1": [1], "w2": [0]}, None, "10.9.9.9", "pdsh")


def test_plan_hostfile_single_host_runs_here_unless_forced():
    assert make_plan(_flags("--include", "w1"), HOSTFILE, "", _never) == LaunchPlan(
        {"w1": [0, 1]}, 0, "127.0.0.1", "pdsh"
    )
    assert make_plan(_flags("--include", "w1", "--force_multi"), HOSTFILE, "", _never).node_rank is None


def test_plan_hostfile_no_ssh_runs_one_node_here():
    plan = make_plan(_flags("--no_ssh", "--node_rank", "2"), HOSTFILE, "", _never)
    assert plan == LaunchPlan({"w0": [0, 1], "w1": [0, 1], "w2": [0]}, 2, "w0", "pdsh")
    with pytest.raises(LauncherError) as info:
        make_plan(_flags("--no_ssh"), HOSTFILE, "", _never)
    assert str(info.value) == "--no_ssh starts one node per invocation: add --node_rank (0..N-1)"


def test_pid_file_is_deepspeeds():
    from zerospeed.launcher.pidfile import pid_file_path

    assert pid_file_path(4242) == "/tmp/4242.deepspeed"
    assert cli.DEFAULT_MASTER_PORT == 29500


@pytest.mark.parametrize(
    "flags, world",
    [
        (["--hostfile", "{hostfile}", "--include", "w0:0,1@w1"], TrialWorld((2, 2), hostfile=True)),
        (["--hostfile", "{hostfile}", "--num_nodes", "1"], TrialWorld((4,), hostfile=True)),
        (["--num_gpus", "3"], TrialWorld((3,), hostfile=False)),
    ],
)
def test_autotuning_gets_the_launchers_world(tmp_path, monkeypatch, flags, world):
    """The autotuner reads no hostfile: the launcher resolves hosts and slots and passes them on."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=4\nw1 slots=2\n")
    seen = {}
    monkeypatch.setattr(launcher_hostfile, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))  # not this machine's
    monkeypatch.setattr(cli.autotuning, "autotune", lambda *a: seen.setdefault("call", a) and 0)
    argv = [f.format(hostfile=hostfile) for f in flags] + ["--autotuning", "tune", "t.py", "--deepspeed", "c.json"]
    assert main(argv) == 0
    mode, passed_argv, command, got = seen["call"]
    assert (mode, passed_argv, command.script, got) == ("tune", argv, "t.py", world)
