"""The elastic agent's pure parts: rendezvous plan, failure reports, error files, rank variables."""

import json
import os
import sys

import pytest

from zerospeed.launcher import worker
from zerospeed.launcher.agent import exit_code, failure_report, failure_traceback, root_failures
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.multinode import node_label
from zerospeed.launcher.rank_hook import sitecustomize as rank_hook
from zerospeed.launcher.rendezvous import (
    RendezvousPlan,
    elastic_nodes,
    missing_nodes,
    rendezvous_plan,
    timeout_message,
    unreachable_message,
)


def _plan(**kw) -> RendezvousPlan:
    args = {"master_addr": "10.0.0.1", "master_port": 29500, "node_rank": 1, "num_nodes": 3, "elastic": None, "env": {}}
    return rendezvous_plan(**{**args, **kw})


def test_rendezvous_plan_node_0_hosts_the_store():
    assert _plan(node_rank=0).is_host and not _plan(node_rank=2).is_host
    elastic = _plan(elastic=(1, 4))
    assert (elastic.min_nodes, elastic.max_nodes, elastic.pinned, elastic.num_nodes) == (1, 4, False, 3)


@pytest.mark.parametrize(
    "given, expected",
    [((None, None), (1, 3)), ((-1, -1), (1, 3)), ((2, None), (2, 3)), ((None, 5), (1, 5)), ((3, 3), (3, 3))],
)
def test_elastic_nodes_defaults(given, expected):
    assert elastic_nodes(3, *given) == expected


@pytest.mark.parametrize("given", [(0, 2), (3, 2)])
def test_elastic_nodes_bad(given):
    with pytest.raises(LauncherError, match="need 1 <= min <= max"):
        elastic_nodes(3, *given)


def test_missing_nodes():
    assert missing_nodes({0: 1, 2: 1}, 3, 1) == [1]
    assert missing_nodes({0: 2, 1: 1, 2: 2}, 3, 2) == [1]  # node 1 has not come back for round 2
    assert missing_nodes({}, 2, 1) == [0, 1]
    assert missing_nodes({0: 1, 1: 1}, 2, 1) == []


def test_timeout_and_unreachable_messages_name_the_nodes():
    plan = _plan(node_rank=0, env={"ZEROSPEED_RDZV_TIMEOUT": "5"})
    assert timeout_message(plan, [1, 2]) == (
        "node 0: the rendezvous at 10.0.0.1:29500 timed out after 5 s: node(s) 1, 2 of 3 never arrived; start the "
        "missing node launchers (same --master_addr/--master_port), or wait longer with ZEROSPEED_RDZV_TIMEOUT=SECONDS"
    )
    assert "fewer than 3 node(s) were ready" in timeout_message(plan, [])
    assert unreachable_message(_plan(env={"ZEROSPEED_RDZV_TIMEOUT": "5"}), TimeoutError("x")) == (
        "node 1: cannot reach the rendezvous store at 10.0.0.1:29500, which node 0 hosts, within 5 s: node 0 never "
        "arrived, or 10.0.0.1:29500 is not reachable from this host (check --master_addr/--master_port and the "
        "firewall) (x)"
    )


@pytest.mark.parametrize(
    "codes, roots",
    [
        ({1: 3, 0: -15}, [1]),  # rank 1 failed; the agent SIGTERMed rank 0
        ({0: 1, 1: 2, 2: -15}, [0, 1]),
        ({1: -9, 0: -15}, [1]),  # the OOM killer's SIGKILL
        ({0: -15, 1: -15}, [0, 1]),  # SIGTERM from outside
    ],
)
def test_root_failures(codes, roots):
    assert root_failures(codes) == roots


def test_exit_code():
    assert (exit_code(3), exit_code(-9), exit_code(-15)) == (3, 137, 143)


def _raise_from_user_code():
    def inner():
        raise ValueError("bad input 7")

    try:
        inner()
    except ValueError as exc:
        return exc


def test_error_record_is_read_back_by_torch(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    # The record a rank's start-up hook writes at exit (tests/dist/test_launcher_procs.py runs it in ranks).
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps(rank_hook.error_record(_raise_from_user_code(), 1700000000.5)))
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(error_file))
    assert failure.timestamp == 1700000000
    tb = failure_traceback(failure.error_file_data)
    assert tb.splitlines()[0] == "Traceback (most recent call last):" and "in inner" in tb
    assert tb.rstrip().endswith("ValueError: bad input 7")
    report = failure_report("zerospeed node 1", 3, failure, 1, "/logs/p_rank3.log")
    assert report.splitlines()[0] == (
        "zerospeed node 1: rank 3 (pid 4242) exited with code 1; stopped the other 1 "
        "process(es); its output is in /logs/p_rank3.log"
    )
    assert report.splitlines()[1] == "zerospeed node 1: rank 3's traceback:"
    assert report.endswith("ValueError: bad input 7")


@pytest.mark.parametrize("given", [None, "", "/a", f"/a{os.pathsep}/b", f"{os.pathsep}/a"])
def test_the_rank_hook_gives_back_the_pythonpath_it_was_given(given):
    with_hook = worker.pythonpath_with(given, worker.HOOK_DIR)
    assert with_hook.split(os.pathsep)[0] == worker.HOOK_DIR == rank_hook.HERE
    assert rank_hook.pythonpath_without(with_hook, worker.HOOK_DIR) == given


def test_rank_command_lines_are_torchruns():
    py = "/env/bin/python"
    assert worker.command_line("script", ["t.py", "--local_rank=0", "a b"], py) == [
        py,
        "-u",
        "t.py",
        "--local_rank=0",
        "a b",
    ]
    assert worker.command_line("module", ["pkg.m", "x"], py) == [py, "-u", "-m", "pkg.m", "x"]
    assert worker.command_line("exec", ["./run.sh", "--local_rank=1"], py) == ["./run.sh", "--local_rank=1"]


def test_failure_report_without_error_file(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert failure_report("zerospeed", 0, failure, 2, None) == (
        "zerospeed: rank 0 (pid 7) was killed by signal SIGKILL; stopped the other 2 process(es)"
    )


def test_zerospeed_variables_from_the_agents():
    agent_env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",
        "GROUP_WORLD_SIZE": "3",
    }
    assert worker.zerospeed_variables(agent_env) == {"LOCAL_SIZE": "2", "CROSS_RANK": "2", "CROSS_SIZE": "3"}
    assert worker.log_path("/logs", "20240102030405", "5") == "/logs/20240102030405_rank5.log"


@pytest.mark.parametrize("module", [worker, rank_hook])
def test_worker_file_imports_nothing_of_zerospeed_or_torch(module):
    # It must start fast: python -X importtime would list them; the source is the cheaper check. The
    # rank's start-up hook runs before every rank's own code, also in scripts that never import torch.
    with open(module.__file__) as f:
        source = f.read()
    imports = [line.split()[1] for line in source.splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert not [m for m in imports if m.split(".")[0] in ("zerospeed", "torch")], imports
    assert sys.modules[module.__name__] is module


def test_node_label_names_the_ranks():
    world = {"w0": [0, 1], "w1": [0], "w2": [3, 4, 5]}
    assert [node_label(world, i) for i in range(3)] == [
        "node 0 on w0 (ranks 0-1)",
        "node 1 on w1 (rank 2)",
        "node 2 on w2 (ranks 3-5)",
    ]
