"""Elastic training through torch's elastic agent: 2 ranks, one node dies -> 1 rank, a node joins -> 2 ranks.

Each "node" is one process running torch's elastic agent (`torch.distributed.launcher.api.elastic_launch`,
what `torchrun` runs: a `LocalElasticAgent` with a c10d rendezvous, `min_nodes=1, max_nodes=2`,
one worker) on loopback. The worker (`worker` below) saves a checkpoint every step and on start loads
`latest`; the `elasticity` block gives it the same global batch (8) at 1 and 2 ranks by changing the
accumulation steps (4 and 2). The test

1. starts agents A (the rendezvous store's host) and B; both ranks train steps 1-2;
2. kills B's agent and worker with SIGKILL (a lost node): A's worker fails in its next collective, A's
   agent restarts it in a new rendezvous round without B, and it resumes from step 2 at world size 1
   (the checkpoint reshards from 2 ranks to 1) and trains steps 3-4;
3. starts agent C (its process starts during step 2, the agent once step 4 is saved): A's agent sees
   the waiting node and restarts its worker; A and C resume from step 4 at world size 2 and train
   steps 5-6; both agents exit 0, and no process is left.

Note [forked workers]: `torchrun script.py` starts every worker as a new interpreter, and importing
torch and zerospeed there took about 5 s at light load and 12-20 s at a load average of 10 on 2
cores, three generations of workers in all; the agents here start their workers with the "fork"
start method from a process that has imported both (and torch._dynamo, which torch.optim's
constructors import), so a restart costs well under a second. Everything else -- the agent,
rendezvous, failure detection, restarts on membership change -- is torch's, as under torchrun.

Workers wait at a gate file before each step, so the membership changes happen between steps, where
the test puts them. Every step's loss (the mean over the global batch, before the update) must equal
that of one plain PyTorch process training on the same global batches (fp32, <= 1e-5) -- which is what
sequential runs at world sizes 2, 1, 2 resuming from checkpoints give, as each step is the same global
step at any world size. Agent and worker output is shown when anything fails or times out.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 6
GLOBAL_BATCH = 8
ELASTICITY = {"enabled": True, "max_train_batch_size": GLOBAL_BATCH, "micro_batch_sizes": [2], "min_gpus": 1,
              "max_gpus": 2}
CONFIG = {"elasticity": ELASTICITY, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 2}}
DIM, HIDDEN = 16, 64  # 2,128 parameters


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM))


def global_batch(step: int):
    """The samples of global step `step` (0-based), the same at every world size."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g)


# --- the worker -------------------------------------------------------------------------------------

def _wait_gate(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


def worker(out: Path) -> None:
    import datetime

    import torch
    import torch.nn.functional as F

    import zerospeed
    from zerospeed import comm

    node = os.environ["ELASTIC_NODE"]
    (out / f"pid.{node}.{os.getpid()}").touch()  # the test kills a node's workers by these
    comm.init_distributed(timeout=datetime.timedelta(seconds=30))  # a lost peer must fail, never hang
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    ckpt = out / "ckpt"
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    def record(event: dict) -> None:
        if rank == 0:
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps({**event, "time": round(time.time(), 2), "world": world, "micro": micro, "gas": gas,
                                    "train_batch": engine.train_batch_size(), "node": node}) + "\n")

    record({"event": "start", "step": engine.global_steps})
    while engine.global_steps < STEPS:
        step = engine.global_steps
        _wait_gate(out / f"go{step + 1}")
        x, y = global_batch(step)
        total = torch.zeros(())
        for m in range(gas):  # micro-step m of rank r takes the (m * world + r)-th slice of the global batch
            lo = (m * world + rank) * micro
            loss = F.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        record({"event": "step", "step": step + 1, "loss": total.item() / (gas * world)})  # before the save: a
        engine.save_checkpoint(str(ckpt))  # step killed between the two is redone and logged again
        record({"event": "saved", "step": step + 1})


def agent(out: Path, port: int, host: bool, join_gate: Path | None) -> None:
    """One node: torch's elastic agent running one worker (Note [forked workers]); with `join_gate`, the
    agent starts (joins the job) once that file exists, so its imports are done before."""
    import torch  # noqa: F401  (imported here so that forked workers start warm)
    import torch._dynamo  # noqa: F401  (torch.optim's constructors import it: 2-4 s)
    import zerospeed.runtime.initialize  # noqa: F401
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if join_gate is not None:
        _wait_gate(join_gate)

    # Note [agent store on membership change]: with the agent's TCPStore shared with the workers (torch's
    # default), a node that joins a running job waits forever in RendezvousStoreInfo.build for the
    # MASTER_ADDR that rank 0, holding its store info from the earlier round, never writes again (torch
    # 2.13; pytorch #135712 is the restart side of it). A fresh worker store per round avoids it.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rdzv = {"is_host": host, "join_timeout": 60, "last_call_timeout": 2, "close_timeout": 5,
            "keep_alive_interval": 1, "keep_alive_max_attempt": 3}  # a lost node is dropped after 3 s
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, run_id="zerospeed-elastic",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs=rdzv,
                          max_restarts=3, monitor_interval=0.1, start_method="fork", local_addr="127.0.0.1")
    elastic_launch(config, worker)(out)


# --- the test ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_losses() -> list[float]:
    """One plain PyTorch process on the same global batches (Adam with weight_decay 0 = zerospeed's "Adam")."""
    import torch
    import torch.nn.functional as F

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class Job:
    """The agents of one elastic job, their logs, and the worker log they write."""

    def __init__(self, out: Path):
        self.out, self.port, self.agents = out, _free_port(), {}
        self.log = out / "log.jsonl"

    def start(self, node: str, host: bool, join_gate: str = "") -> None:
        cmd = [sys.executable, __file__, "agent", str(self.out), str(self.port), str(int(host)), join_gate]
        env = {**os.environ, "ELASTIC_NODE": node, "LOGLEVEL": "INFO", "ZEROSPEED_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH", "")])}
        log = open(self.out / f"agent.{node}.log", "w")
        self.agents[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def worker_pids(self, node: str) -> list[int]:
        return [int(p.name.split(".")[2]) for p in self.out.glob(f"pid.{node}.*")]

    def kill_node(self, node: str) -> None:
        """SIGKILL the agent and then its workers (they run in their own sessions): a lost machine."""
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        self.agents[node].wait()
        for pid in self.worker_pids(node):
            _kill(pid)

    def open_gates(self, *steps: int) -> None:
        for step in steps:
            (self.out / f"go{step}").touch()

    def wait(self, what: str, found, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not found(self.events()):
            failed = {n: a.returncode for n, a in self.agents.items() if a.poll() not in (None, 0, -9)}
            if failed or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: " + ("agents failed " + str(failed) if failed else
                                     f"timed out after {timeout:g} s") + "\n" + self.report())
            time.sleep(0.05)

    def report(self) -> str:
        parts = [f"--- worker log\n{self.log.read_text() if self.log.exists() else '(none)'}"]
        for node in self.agents:
            text = (self.out / f"agent.{node}.log").read_text()
            parts.append(f"--- agent {node} (exit {self.agents[node].poll()}), last 6000 chars\n{text[-6000:]}")
        return "\n".join(parts)

    def cleanup(self) -> list[int]:
        """Kill whatever is left; return the pids that were still alive (orphans)."""
        alive = []
        for node, agent in self.agents.items():
            if agent.poll() is None:
                alive.append(agent.pid)
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for node in self.agents:
            for pid in self.worker_pids(node):
                if _kill(pid):
                    alive.append(pid)
        return alive


def _kill(pid: int) -> bool:
    """SIGKILL `pid` if it still runs (a zombie does not count); True if it did."""
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (psutil.NoSuchProcess, ProcessLookupError):
        return False


def _saved(events, step: int, world: int) -> bool:
    return any(e["event"] == "saved" and e["step"] == step and e["world"] == world for e in events)


def _started(events, world: int, at_step: int) -> bool:
    return any(e["event"] == "start" and e["world"] == world and e["step"] == at_step for e in events)


@pytest.mark.timeout(240)  # every wait below is bounded too, and a failure shows the agents' output
def test_shrink_and_grow_resume_from_checkpoints_with_a_fixed_global_batch(tmp_path):
    start = time.monotonic()
    job = Job(tmp_path)
    orphans = []
    try:
        job.start("A", host=True)
        job.start("B", host=False)
        job.wait("both ranks to start", lambda ev: _started(ev, world=2, at_step=0), 40)
        job.open_gates(1, 2)
        job.wait("step 2 saved at world size 2", lambda ev: _saved(ev, 2, world=2), 20)
        job.kill_node("B")
        job.start("C", host=False, join_gate=str(tmp_path / "join.C"))  # imports while the job shrinks
        job.open_gates(3, 4)
        job.wait("step 4 saved at world size 1", lambda ev: _saved(ev, 4, world=1), 40)
        (tmp_path / "join.C").touch()
        job.wait("two ranks resuming at step 4", lambda ev: _started(ev, world=2, at_step=4), 40)
        job.open_gates(5, 6)
        for node in ("A", "C"):
            try:
                code = job.agents[node].wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {node} did not exit\n{job.report()}") from None
            assert code == 0, f"agent {node} exited {code}\n{job.report()}"
    finally:
        orphans = job.cleanup()
    assert not orphans, f"processes left running: {orphans}\n{job.report()}"
    elapsed = time.monotonic() - start

    events = job.events()
    steps = [e for e in events if e["event"] == "step"]
    worlds = {e["step"]: e["world"] for e in steps}
    assert worlds == {1: 2, 2: 2, 3: 1, 4: 1, 5: 2, 6: 2}, job.report()
    # the global batch is fixed; the accumulation steps make it up at each world size
    assert {(e["world"], e["micro"], e["gas"], e["train_batch"]) for e in events} == {(2, 2, 2, 8), (1, 2, 4, 8)}
    assert [e["step"] for e in events if e["event"] == "start"][-2:] == [2, 4]  # resumed from the checkpoints
    losses = {}
    for e in steps:  # a step logged twice (killed before its save) must give the same loss both times
        assert losses.setdefault(e["step"], e["loss"]) == pytest.approx(e["loss"], abs=1e-6)
    reference = reference_losses()
    got = [losses[s] for s in range(1, STEPS + 1)]
    assert max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (got, reference)
    print(f"elastic 2 -> 1 -> 2 ranks: {elapsed:.1f} s; losses {got}")


if __name__ == "__main__":
    agent(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", Path(sys.argv[5]) if sys.argv[5] else None)
