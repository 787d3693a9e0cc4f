"""Run a function in N spawned processes joined by a gloo group, as a test would.

`run_distributed(fn, world_size)` returns each rank's result in rank order. If a rank raises, the
others are stopped and `DistributedTestError` carries that rank's own traceback into pytest. If the
job outlives `timeout`, every rank's Python stack is dumped (faulthandler) and shown in the error,
so a hang says where each rank was stuck.

Ranks start from a fork server that has already imported torch and zerospeed's engine (Note [fork
server]); `ZEROSPEED_TEST_START_METHOD=spawn` gives every rank a fresh interpreter instead.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerospeed.utils.ports import free_port


class DistributedTestError(AssertionError):
    """A rank failed or the job timed out; the message holds the rank's traceback."""


# Note [fork server]
# Most of a small multi-process test is starting its ranks: a fresh interpreter spends ~2 s of CPU
# importing torch and zerospeed, and on 2 cores four ranks do that two at a time. The "forkserver"
# start method execs one clean server process (it inherits nothing from pytest), which imports the
# modules in _PRELOAD once; every rank is then a fork of it, with those imports already done. The
# server has run no torch op and started no thread, so forking it is safe; each rank still makes its
# own process group, thread pool and accelerator choice after the fork. Two differences from
# "spawn" are handled here: the server's environment is the one it started with, so each rank
# replaces its environment with the caller's of the moment (a test's monkeypatched variables reach
# the ranks); and the preloaded modules are imported once per pytest run, so they must not read the
# environment at import time (they read it when called). Two imports every rank would otherwise pay
# on its own, measured on 2 cores: torch._dynamo (~2.2 s), which torch imports the first time any
# optimizer is built (its constructor is wrapped by torch._compile's dynamo-disable decorator), and
# transformers' modeling_utils (~2.1 s), which every test on a transformers model imports. Neither
# starts a thread; transformers is skipped where it is not installed (the server ignores ImportError).
# Their import-time settings (TORCHDYNAMO_*, HF_* / TRANSFORMERS_*) are the pytest run's, not a test's.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "zerospeed",
    "zerospeed.runtime.engine",
    "harness",
    "transformers.modeling_utils",
]


def _context():
    method = os.environ.get("ZEROSPEED_TEST_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"ZEROSPEED_TEST_START_METHOD={method!r}: use 'forkserver' or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(fn, rank, world_size, port, args, kwargs, results, stack_file, timeout, env, backend, caller_env):
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "ZEROSPEED_ACCELERATOR": "cuda" if backend == "nccl" else "cpu",
            **env,
        }
    )
    with open(stack_file, "w") as stacks:
        # Dump this rank's stack shortly before the parent gives up, so a hang is explained.
        faulthandler.dump_traceback_later(max(1.0, timeout - 3.0), exit=False, file=stacks)
        try:
            import torch

            torch.set_num_threads(1)
            from zerospeed import comm

            comm.init_distributed(dist_backend=backend)
            out = fn(*args, **kwargs)
            # Plain pickle: tensors travel by value, not as shared-memory handles that die with us.
            results.put((rank, "ok", pickle.dumps(out)))
        except BaseException as exc:  # noqa: BLE001 — every failure must reach the parent
            results.put((rank, "error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()
            try:
                from zerospeed import comm

                comm.destroy()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` ranks; return the results in rank order.

    `fn` must be importable (a module-level function) and its result picklable. backend "gloo"
    runs on the CPU; "nccl" puts rank r on GPU r.
    """
    if backend == "nccl":
        import torch

        if world_size > torch.cuda.device_count():
            raise ValueError(
                f"run_distributed(backend='nccl', world_size={world_size}): this machine has "
                f"{torch.cuda.device_count()} GPU(s) and NCCL needs one per rank; skip the test "
                "below that many GPUs or use backend='gloo'"
            )
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zs-spawn-") as tmp:
        stack_files = [Path(tmp) / f"rank{r}.stack" for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_child,
                daemon=True,
                args=(
                    fn,
                    r,
                    world_size,
                    port,
                    args,
                    kwargs,
                    results,
                    str(stack_files[r]),
                    timeout,
                    env or {},
                    backend,
                    dict(os.environ),
                ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, stack_files)
        finally:
            _stop(procs)


def _collect(procs, results, world_size, timeout, stack_files) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                time.sleep(0.5)
                stacks = "\n".join(
                    f"--- rank {r} stack ---\n{stack_files[r].read_text()}" for r in missing if stack_files[r].exists()
                )
                raise DistributedTestError(
                    f"timed out after {timeout:.0f}s; ranks {missing} did not finish\n{stacks}"
                ) from None
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
            if dead:
                time.sleep(0.5)  # its error report may still be in flight
                if results.empty():
                    raise DistributedTestError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                        "without reporting (killed? out of memory?)"
                    ) from None
            continue
        if status == "error":
            raise DistributedTestError(f"rank {rank} failed:\n{payload}")
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()


def per_world(fn, *args, timeout: float = 280.0, then=None):
    """A getter `get(world)` that runs `fn(*args)` on `world` ranks the first time a world size is asked
    for and keeps the per-rank results (mapped through `then` when given): a module fixture returns it,
    so every test of a module shares one spawn per world size (starting processes is the slow part on a
    small machine)."""
    cache: dict[int, object] = {}

    def get(world: int):
        if world not in cache:
            results = run_distributed(fn, world, *args, timeout=timeout)
            cache[world] = then(results) if then is not None else results
        return cache[world]

    return get
