"""The elastic agent's pure parts: rendezvous plan, failure reports, error files, rank variables."""
import sys

import pytest

from zerospeed.launcher import worker
from zerospeed.launcher.agent import (RendezvousPlan, elastic_nodes, exit_code, failure_report, failure_traceback,
                                      missing_nodes, rendezvous_plan, root_failures, timeout_message,
                                      unreachable_message)
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.multinode import node_label


def _plan(**kw) -> RendezvousPlan:
    args = {"master_addr": "10.0.0.1", "master_port": 29500, "node_rank": 1, "num_nodes": 3, "elastic": None,
            "env": {}}
    return rendezvous_plan(**{**args, **kw})


def test_rendezvous_plan_node_0_hosts_the_store():
    assert _plan(node_rank=0).is_host and not _plan(node_rank=2).is_host
    elastic = _plan(elastic=(1, 4))
    assert (elastic.min_nodes, elastic.max_nodes, elastic.pinned, elastic.num_nodes) == (1, 4, False, 3)


@pytest.mark.parametrize("given, expected", [((None, None), (1, 3)), ((-1, -1), (1, 3)), ((2, None), (2, 3)),
                                             ((None, 5), (1, 5)), ((3, 3), (3, 3))])
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
        "missing node launchers (same --master_addr/--master_port), or wait longer with ZEROSPEED_RDZV_TIMEOUT=SECONDS")
    assert "fewer than 3 node(s) were ready" in timeout_message(plan, [])
    assert unreachable_message(_plan(env={"ZEROSPEED_RDZV_TIMEOUT": "5"}), TimeoutError("x")) == (
        "node 1: cannot reach the rendezvous store at 10.0.0.1:29500, which node 0 hosts, within 5 s: node 0 never "
        "arrived, or 10.0.0.1:29500 is not reachable from this host (check --master_addr/--master_port and the "
        "firewall) (x)")


@pytest.mark.parametrize("codes, roots", [
    ({1: 3, 0: -15}, [1]),            # rank 1 failed; the agent SIGTERMed rank 0
    ({0: 1, 1: 2, 2: -15}, [0, 1]),
    ({1: -9, 0: -15}, [1]),           # the OOM killer's SIGKILL
    ({0: -15, 1: -15}, [0, 1]),       # SIGTERM from outside
])
def test_root_failures(codes, roots):
    assert root_failures(codes) == roots


def test_exit_code():
    assert (exit_code(3), exit_code(-9), exit_code(-15)) == (3, 137, 143)


def _failing_script(tmp_path):
    script = tmp_path / "user.py"
    script.write_text("def inner():\n    raise ValueError('bad input 7')\n\ninner()\n")
    return str(script)


def test_error_record_is_read_back_by_torch(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file, printed = tmp_path / "error.json", []
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "excepthook", lambda *exc_info: printed.append(exc_info))
    monkeypatch.setattr(worker.time, "time", lambda: 1700000000.5)
    with pytest.raises(SystemExit) as info:
        worker._run("script", [_failing_script(tmp_path), "--local_rank=0"])  # what a rank runs
    assert info.value.code == 1
    assert [type(exc) for _, exc, _ in printed] == [ValueError]  # python's own report of the exception
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(error_file))
    assert failure.timestamp == 1700000000
    tb = failure_traceback(failure.error_file_data)
    # The user's frames only: no runpy or test frames before the script's.
    assert tb.splitlines()[:2] == ["Traceback (most recent call last):",
                                   f'  File "{tmp_path}/user.py", line 4, in <module>']
    assert tb.rstrip().endswith("ValueError: bad input 7")
    report = failure_report("zerospeed node 1", 3, failure, 1, "/logs/p_rank3.log")
    assert report.splitlines()[0] == ("zerospeed node 1: rank 3 (pid 4242) exited with code 1; stopped the other 1 "
                                      "process(es); its output is in /logs/p_rank3.log")
    assert report.splitlines()[1] == "zerospeed node 1: rank 3's traceback:"
    assert report.endswith("ValueError: bad input 7")


def test_failure_report_without_error_file(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert failure_report("zerospeed", 0, failure, 2, None) == (
        "zerospeed: rank 0 (pid 7) was killed by signal SIGKILL; stopped the other 2 process(es)")


def test_zerospeed_variables_from_the_agents():
    agent_env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
                 "GROUP_WORLD_SIZE": "3"}
    assert worker.zerospeed_variables(agent_env) == {"LOCAL_SIZE": "2", "CROSS_RANK": "2", "CROSS_SIZE": "3"}
    assert worker.log_path("/logs", "20240102030405", "5") == "/logs/20240102030405_rank5.log"


def test_worker_file_imports_nothing_of_zerospeed_or_torch():
    # It must start fast: python -X importtime would list them; the source is the cheaper check.
    with open(worker.__file__) as f:
        source = f.read()
    imports = [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [m for m in imports if m.split(".")[0] in ("zerospeed", "torch")], imports
    assert sys.modules["zerospeed.launcher.worker"] is worker


def test_node_label_names_the_ranks():
    world = {"w0": [0, 1], "w1": [0], "w2": [3, 4, 5]}
    assert [node_label(world, i) for i in range(3)] == ["node 0 on w0 (ranks 0-1)", "node 1 on w1 (rank 2)",
                                                        "node 2 on w2 (ranks 3-5)"]
