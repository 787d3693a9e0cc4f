"""Run a function on N local processes joined by a gloo group: how ``--measure`` trains on N ranks.

Each rank is a fresh interpreter (the "spawn" start method: nothing of the caller's state is shared)
with the environment variables ``init_distributed`` reads; results come back pickled, in rank order.
A rank that raises stops the job and its traceback becomes the error; so does a job past its timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.utils.ports import free_port


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time."""


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "ZEROSPEED_ACCELERATOR": "cpu",
        }
    )
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores
        comm.init_distributed(dist_backend="gloo")
        results.put((rank, True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 (every failure must reach the parent)
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        comm.destroy()


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo ranks (``fn`` importable, its result picklable); results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return _gather(procs, results, timeout)
    except BaseException:
        for p in procs:  # the others may wait on the failed rank in a collective: stop them now
            p.terminate()
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _gather(procs: list, results, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RanksFailed(
                    f"ranks {sorted(set(range(len(procs))) - set(out))} did not finish within {timeout:.0f} s"
                ) from None
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
            if dead and results.empty():
                time.sleep(0.5)  # a report sent just before dying may still be in the pipe
                if results.empty():
                    raise RanksFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if not ok:
            raise RanksFailed(f"rank {rank} failed:\n{payload}")
        out[rank] = payload
    return [out[r] for r in range(len(procs))]
