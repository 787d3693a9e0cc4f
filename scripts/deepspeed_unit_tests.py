#!/usr/bin/env python
"""Run a CPU-runnable selection of DeepSpeed's own unit tests, unchanged, on the real DeepSpeed and on
zerospeed through the `deepspeed` shim, and print a per-file passed / failed / skipped table.

DeepSpeed's tests are not part of this repository (they must not be committed here). Take them from a
DeepSpeed checkout, e.g. the bare mirror:

    git -C /work/.mirror/deepspeedai+DeepSpeed/repo archive HEAD tests | tar -x -C /tmp/dstests
    pip install --target /tmp/ds-test-deps py-cpuinfo   # imported by the CPU Adam tests themselves
    python scripts/deepspeed_unit_tests.py /tmp/dstests/tests --lock /tmp/zs-test.lock --test-deps /tmp/ds-test-deps

Each side is one Python interpreter with pytest: `--deepspeed-python` has the real DeepSpeed installed
(DS_BUILD_OPS=0 is fine: CPU tests build nothing), `--zerospeed-python` has zerospeed with
`zerospeed-compat install`'s shim, so `import deepspeed` is zerospeed. Each file runs in its own pytest
process from the tests directory (DeepSpeed's conftest.py and `unit.common` come along) with
`LOCAL_SIZE=2`, which makes DeepSpeed's CPU accelerator report two devices so its 2-process tests run;
a file that outlives `--timeout` is killed and counted as it stood (the tests it had not finished count
as failed). Counts come from pytest's verbose result lines.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

# The selection: config, LR schedules, initialize, ZeRO 1-3, zero.Init, leaf modules, checkpoints, CPU
# optimizers, pipeline schedule / topology / partitioning, MoE, launcher, comms logger, monitors, utils.
FILES = (
    "runtime/test_ds_config_dict.py",
    "runtime/test_ds_config_model.py",
    "runtime/zero/test_zero_config.py",
    "runtime/test_lr_schedulers.py",
    "runtime/test_ds_initialize.py",
    "runtime/test_runtime_utils.py",
    "runtime/test_no_sync_ctxt.py",
    "runtime/half_precision/test_dynamic_loss_scale.py",
    "runtime/zero/test_zero_context.py",
    "runtime/zero/test_zero_context_return.py",
    "runtime/zero/test_zero_dynamic_class.py",
    "runtime/zero/test_zero_leaf_module.py",
    "runtime/zero/test_zero_tensor_fragment.py",
    "runtime/zero/test_ignore_unused_parameters.py",
    "runtime/pipe/test_pipe_schedule.py",
    "runtime/pipe/test_topology.py",
    "runtime/utils/test_partition.py",
    "runtime/activation_checkpointing/test_activation_checkpointing.py",
    "checkpoint/test_latest_checkpoint.py",
    "checkpoint/test_tag_validation.py",
    "checkpoint/test_lr_scheduler.py",
    "ops/adam/test_cpu_adam.py",
    "v1/moe/test_moe.py",
    "launcher/test_ds_arguments.py",
    "launcher/test_run.py",
    "launcher/test_user_args.py",
    "launcher/test_multinode_runner.py",
    "comm/test_comms_logger.py",
    "monitor/test_monitor.py",
    "utils/test_groups.py",
    "utils/test_partition_balanced.py",
    "utils/test_init_on_device.py",
    "elasticity/test_elastic.py",
    "profiling/flops_profiler/test_flops_profiler.py",
)

_RESULT = re.compile(r"^(\S+::\S+(?:\[.*\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# Files that take over a minute on DeepSpeed here (2 shared cores: each 2-process test spawns its processes);
# `--quick` leaves them out, which keeps one pass of each side under 10 minutes
SLOW = (
    "runtime/test_lr_schedulers.py",
    "runtime/test_ds_initialize.py",
    "runtime/test_no_sync_ctxt.py",
    "runtime/zero/test_zero_tensor_fragment.py",
    "ops/adam/test_cpu_adam.py",
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KEEP = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped", "XFAIL": "skipped"}


@contextlib.contextmanager
def _locked(path: str | None):
    """Hold the shared test lock (per file, so others' test runs interleave with a long comparison)."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def parse(output: str) -> dict[str, str]:
    """Test id -> passed / failed / skipped, from pytest's verbose lines (the last word on a test wins)."""
    results: dict[str, str] = {}
    for line in _ANSI.sub("", output).splitlines():
        match = _RESULT.match(line.strip())
        if match:
            results[match.group(1)] = _KEEP.get(match.group(2), "passed")
    return results


def run_file(
    python: str, tests_dir: pathlib.Path, path: str, timeout: float, lock: str | None, test_deps: str | None = None
) -> dict:
    """One file in one pytest process: its counts, wall time, and the output's tail for the report."""
    env = dict(os.environ, LOCAL_SIZE="2", DS_ACCELERATOR="cpu", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    if test_deps:  # the tests' own imports (py-cpuinfo), the same directory on both sides
        env["PYTHONPATH"] = test_deps
    cmd = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-m", _MARKS, f"unit/{path}"]
    cmd += ["-W", "ignore::DeprecationWarning"]
    with _locked(lock):
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=tests_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        wall = time.monotonic() - start
    text = _ANSI.sub("", out.decode(errors="replace"))
    results = parse(text)
    counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "failed", "skipped")}
    collected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?", text)
    if collected and not timed_out:
        unreported = int(collected.group(1)) - int(collected.group(2) or 0) - sum(counts.values())
        counts["failed"] += max(unreported, 0)
    stopped = bool(re.search(r"errors? during collection", text)) or (not collected and not timed_out)
    return {
        **counts,
        "collection_error": stopped,  # the file did not import (its tests did not run)
        "timed_out": timed_out,
        "wall_s": round(wall, 1),
        "tests": results,
        "tail": text[-6000:],
    }


# DeepSpeed's pytest.ini deselects these; the same, written out so `-o addopts=` can drop its -m only
_MARKS = (
    "not sequential and not nightly and not inference and not seq_inference and not inference_ops and not "
    "inference_v2 and not inference_v2_ops and not stable_diffusion and not evaluation"
)


def table(results: dict[str, dict[str, dict]], files) -> str:
    sides = list(results)
    both = set(sides) == {"deepspeed", "zerospeed"}
    head = "| file | " + " | ".join(f"{s} passed / failed / skipped (s)" for s in sides)
    head += " | pass on both |" if both else " |"
    lines = [head, "|---" * (len(sides) + 1 + both) + "|"]
    total = {s: [0, 0, 0] for s in sides}
    for path in files:
        cells = []
        for side in sides:
            r = results[side].get(path)
            if r is None:
                cells.append("-")
                continue
            for i, k in enumerate(("passed", "failed", "skipped")):
                total[side][i] += r[k]
            flag = " timeout" if r["timed_out"] else " import error" if r.get("collection_error") else ""
            cells.append(f"{r['passed']} / {r['failed']} / {r['skipped']} ({r['wall_s']:.0f}{flag})")
        if set(sides) == {"deepspeed", "zerospeed"} and all(path in results[x] for x in sides):
            cells.append(str(len(_passed(results["deepspeed"][path]) & _passed(results["zerospeed"][path]))))
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    cells = [" / ".join(map(str, total[s])) for s in sides]
    if both:
        cells.append(
            str(
                sum(
                    len(_passed(results["deepspeed"][f]) & _passed(results["zerospeed"][f]))
                    for f in files
                    if all(f in results[x] for x in sides)
                )
            )
        )
    lines.append("| **total** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _passed(result: dict) -> set[str]:
    return {t for t, v in result["tests"].items() if v == "passed"}


def both_pass(results) -> str:
    """How many of the tests that pass on DeepSpeed also pass on zerospeed."""
    if set(results) != {"deepspeed", "zerospeed"}:
        return ""
    ds = {(f, t) for f, r in results["deepspeed"].items() for t, v in r["tests"].items() if v == "passed"}
    zs = {(f, t) for f, r in results["zerospeed"].items() for t, v in r["tests"].items() if v == "passed"}
    share = 100.0 * len(ds & zs) / max(len(ds), 1)
    return f"{len(ds & zs)} of the {len(ds)} tests that pass on DeepSpeed pass on zerospeed ({share:.0f}%)"


def main(argv=None) -> int:
    here = pathlib.Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", type=pathlib.Path, help="DeepSpeed's tests/ directory (holds unit/)")
    parser.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--zerospeed-python", default=str(here / ".venv" / "bin" / "python"))
    parser.add_argument("--side", choices=("both", "deepspeed", "zerospeed"), default="both")
    parser.add_argument("--files", nargs="*", help="a subset of the selection (paths under unit/)")
    parser.add_argument("--quick", action="store_true", help="leave out the SLOW files")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per file before it is killed")
    parser.add_argument("--lock", help="a file to flock around each pytest run (shared CPUs)")
    parser.add_argument(
        "--test-deps",
        help="a directory put on PYTHONPATH on both sides: packages DeepSpeed's tests import themselves that "
        "neither DeepSpeed's runtime nor zerospeed needs (`pip install --target DIR py-cpuinfo`: CPU Adam's tests)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every test's outcome here (merged if it exists)")
    args = parser.parse_args(argv)
    files = args.files or [f for f in FILES if not (args.quick and f in SLOW)]
    sides = ["deepspeed", "zerospeed"] if args.side == "both" else [args.side]
    results: dict[str, dict[str, dict]] = {}
    if args.json and args.json.exists():
        results = json.loads(args.json.read_text())
    for side in sides:
        python = args.deepspeed_python if side == "deepspeed" else args.zerospeed_python
        results.setdefault(side, {})
        for path in files:
            r = run_file(python, args.tests_dir, path, args.timeout, args.lock, args.test_deps)
            results[side][path] = r
            print(
                f"{side:10s} {path:70s} {r['passed']:4d} {r['failed']:4d} {r['skipped']:4d} {r['wall_s']:6.1f}s"
                + (" timeout" if r["timed_out"] else ""),
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    order = [f for f in FILES if any(f in results[s] for s in results)]
    order += sorted({f for s in results for f in results[s]} - set(order))
    print(table(results, order))
    summary = both_pass(results)
    if summary:
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
