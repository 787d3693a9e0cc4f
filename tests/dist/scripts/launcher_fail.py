"""Launcher test helper: record this rank's pid; the rank named by FAIL_RANK exits 3 (or, with
FAIL_RAISE set, raises an exception), others sleep."""

import os
import sys
import time

out = os.environ["ZS_TEST_OUT"]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
if str(rank) == os.environ.get("FAIL_RANK"):
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(out, "pid0")) and time.monotonic() < deadline:
        time.sleep(0.02)  # fail only once rank 0 is surely running
    if os.environ.get("FAIL_RAISE"):
        raise RuntimeError(f"rank {rank} fails on purpose")
    sys.exit(3)
time.sleep(60)
