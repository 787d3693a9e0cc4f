"""Which hosts and slots a job uses: include/exclude filters, node/GPU counts, local detection.

Everything here is a pure function of its arguments except ``detect_device_count`` (which asks
torch, imported lazily because it costs seconds and most launches do not need it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from zerospeed.launcher.errors import LauncherError

SPEC_FORMAT = (
    "expected NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC = HOST[:SLOT[,SLOT ...]] (e.g. 'worker-0:0,2@worker-1')"
)


def parse_node_specs(text: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse ``worker-0:0,2@worker-1`` into ``{"worker-0": [0, 2], "worker-1": None}``.

    ``None`` means "every slot of that host". A host named twice gets the union of its slots
    (and stays ``None`` if either mention is the whole host).
    """
    specs: dict[str, list[int] | None] = {}
    for spec in text.split("@"):
        host, slots = _parse_one_spec(spec, text, flag)
        if slots is None or (host in specs and specs[host] is None):
            specs[host] = None
        else:
            specs[host] = sorted(set(specs.get(host) or []) | set(slots))
    return specs


def _parse_one_spec(spec: str, text: str, flag: str) -> tuple[str, list[int] | None]:
    host, sep, slot_text = spec.partition(":")
    if not host or (sep and not slot_text) or ":" in slot_text:
        raise LauncherError(f"{flag} {text!r}: bad node spec {spec!r}; {SPEC_FORMAT}")
    if not sep:
        return host, None
    try:
        slots = [int(s) for s in slot_text.split(",")]
    except ValueError:
        raise LauncherError(f"{flag} {text!r}: slots in {spec!r} must be integers; {SPEC_FORMAT}") from None
    return host, slots


def filter_resources(
    resources: Mapping[str, int | Sequence[int]], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """Apply DeepSpeed's ``--include`` / ``--exclude`` to ``{host: slot count or slot list}``.

    A host alone selects (or removes) all its slots, ``host:0,2`` only those slots; ``@`` separates
    hosts. The result keeps the resources' host order, lists slots in ascending order and drops
    hosts left without slots. Unknown hosts or slots, using both filters, or filtering everything
    away raise ``LauncherError``.
    """
    pool = {host: _slot_list(v) for host, v in resources.items()}
    if include and exclude:
        raise LauncherError("--include and --exclude are mutually exclusive; use one of them")
    if not include and not exclude:
        return pool
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    specs = parse_node_specs(text, flag)
    _check_specs(specs, pool, flag)
    chosen = _apply_include(specs, pool) if include else _apply_exclude(specs, pool)
    result = {h: chosen[h] for h in pool if chosen.get(h)}
    if not result:
        raise LauncherError(f"{flag} {text!r} leaves no slots to run on")
    return result


def _slot_list(value: int | Sequence[int]) -> list[int]:
    return list(range(value)) if isinstance(value, int) else sorted(value)


def _apply_include(specs: Mapping[str, list[int] | None], pool: Mapping[str, list[int]]) -> dict[str, list[int]]:
    return {host: pool[host] if slots is None else slots for host, slots in specs.items()}


def _apply_exclude(specs: Mapping[str, list[int] | None], pool: Mapping[str, list[int]]) -> dict[str, list[int]]:
    kept: dict[str, list[int]] = {}
    for host, slots in pool.items():
        if host not in specs:
            kept[host] = slots
        elif specs[host] is not None:  # None: the whole host is excluded
            kept[host] = [s for s in slots if s not in specs[host]]
    return kept


def _check_specs(specs: Mapping[str, list[int] | None], pool: Mapping[str, list[int]], flag: str) -> None:
    for host, slots in specs.items():
        if host not in pool:
            raise LauncherError(
                f"{flag} names host {host!r}, which is not among the available hosts ({', '.join(pool)})"
            )
        for slot in slots or ():
            if slot not in pool[host]:
                raise LauncherError(
                    f"{flag} names slot {slot} on host {host!r}, whose slots are {','.join(map(str, pool[host]))}"
                )


def limit_resources(
    resources: Mapping[str, Sequence[int]], num_nodes: int | None, num_gpus: int | None
) -> dict[str, list[int]]:
    """Keep the first ``num_nodes`` hosts and slots ``0..num_gpus-1`` on each (``None``: no limit).

    Asking for more hosts or slots than the hostfile lists is an error rather than a silent
    shrink or an oversubscription.
    """
    hosts = list(resources)
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise LauncherError(
                f"--num_nodes {num_nodes} but only {len(hosts)} host(s) are available ({', '.join(hosts)})"
            )
        hosts = hosts[:num_nodes]
    if num_gpus is None:
        return {h: list(resources[h]) for h in hosts}
    for h in hosts:
        if num_gpus > len(resources[h]):
            raise LauncherError(f"--num_gpus {num_gpus} but host {h!r} has only {len(resources[h])} slot(s)")
    return {h: list(range(num_gpus)) for h in hosts}


def local_slots(num_gpus: int | None, visible_devices: str, device_count: Callable[[], int]) -> list[int]:
    """The slots of this machine when there is no hostfile.

    ``--num_gpus N`` gives ``0..N-1`` (N CPU processes on a machine without GPUs). Otherwise a
    non-empty ``CUDA_VISIBLE_DEVICES`` is respected as DeepSpeed does (its ids become the slots),
    else every GPU ``device_count()`` reports, else one CPU process.
    """
    if num_gpus is not None:
        return list(range(num_gpus))
    if visible_devices.strip():
        try:
            return [int(d) for d in visible_devices.split(",")]
        except ValueError:
            raise LauncherError(
                f"CUDA_VISIBLE_DEVICES={visible_devices!r} is not a list of integer ids; "
                "unset it and select GPUs with --include localhost:0,1"
            ) from None
    count = device_count()
    return list(range(count)) if count > 0 else [0]


def detect_device_count() -> int:
    """Number of CUDA devices torch sees (0 on a CPU-only machine)."""
    import torch  # lazily: a 1-2 s import that launches with --num_gpus or a hostfile skip

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
