"""Binding ranks to CPU cores (`--bind_cores_to_rank`, `--bind_core_list`): pure core arithmetic.

DeepSpeed's rules: the core list ("0,2-4,6": comma-separated numbers and inclusive ranges, ascending,
not overlapping) defaults to every physical core of the host; it is split into equal consecutive
blocks, one per local rank (the remainder is left unused), and each rank runs with OMP_NUM_THREADS set
to its block's size. DeepSpeed binds through `numactl -C` (and `-m` for the NUMA node); zerospeed sets
the affinity of the rank process itself (`os.sched_setaffinity` before it starts), so no numactl is
needed; memory then follows Linux's first-touch placement instead of an explicit NUMA binding.
"""

from __future__ import annotations

from zerospeed.launcher.errors import LauncherError


def _parse_range(text: str, whole: str) -> range:
    parts = text.split("-")
    try:
        if len(parts) == 1:
            return range(int(parts[0]), int(parts[0]) + 1)
        if len(parts) == 2:
            start, end = int(parts[0]), int(parts[1])
            if start <= end:
                return range(start, end + 1)
    except ValueError:
        pass
    raise LauncherError(
        f"--bind_core_list {whole!r}: {text!r} is neither a core number nor a range START-END "
        "with START <= END (example: 0,2-4,6)"
    )


def parse_core_list(text: str) -> list[int]:
    """'0,2-4,6' -> [0, 2, 3, 4, 6]; the pieces must ascend without overlapping."""
    cores: list[int] = []
    for piece in text.split(","):
        block = _parse_range(piece.strip(), text)
        if cores and block[0] <= cores[-1]:
            raise LauncherError(
                f"--bind_core_list {text!r}: {piece!r} overlaps or precedes the cores before it; "
                "list the cores in ascending order, each once"
            )
        cores.extend(block)
    return cores


def cores_for_rank(cores: list[int], local_size: int, local_rank: int) -> list[int]:
    """Local rank `local_rank`'s block of `cores` split evenly over `local_size` ranks."""
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise LauncherError(
            f"--bind_cores_to_rank: {len(cores)} core(s) {cores} cannot give each of {local_size} "
            "local ranks a core of its own; list more cores with --bind_core_list or start fewer "
            "ranks per node"
        )
    return cores[per_rank * local_rank : per_rank * (local_rank + 1)]


def physical_cores() -> list[int]:
    """The host's physical cores as DeepSpeed counts them (psutil, logical=False), numbered from 0."""
    import psutil

    return list(range(psutil.cpu_count(logical=False) or psutil.cpu_count() or 1))
