"""Launcher test helper: "training steps" of a gloo all-reduce until killed or STEPS_MAX steps.

Each rank records its pid (pid<RANK>) and, after every step, the step count (step<RANK>) in
ZS_TEST_OUT, so a test can act mid-step. FAIL_ATTEMPT=N: rank 1 raises in attempt N (restart count).
"""

import datetime
import os
import time

import torch
import torch.distributed as dist


def _write(name: str, text: str) -> None:
    path = os.path.join(os.environ["ZS_TEST_OUT"], name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, attempt = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _write(f"pid{rank}", str(os.getpid()))
    t = torch.ones(4)
    for step in range(1, int(os.environ.get("STEPS_MAX", "100000")) + 1):
        dist.all_reduce(t)
        t /= dist.get_world_size()
        _write(f"step{rank}", str(step))
        if rank == 1 and attempt == os.environ.get("FAIL_ATTEMPT") and step == 2:
            raise RuntimeError(f"rank 1 fails in attempt {attempt}")
        time.sleep(0.05)
    _write(f"done{rank}", f"attempt {attempt} world {dist.get_world_size()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
