"""DeepSpeed's launcher helpers (`deepspeed.launcher.runner`) over zerospeed's launcher parts.

DeepSpeed's runner module exposes the steps of a launch as functions that tools call directly (parse the
flags, read a hostfile, filter hosts and slots, encode the world for the node launchers). Each here is the
launcher's own step (cli.py, hostfile.py, resources.py, world.py) in DeepSpeed's call shape: host tables as
`{host: slot count}` or `{host: [slots]}` in hostfile order, and a filter that removes every slot gives an
empty table rather than an error, as DeepSpeed's does (the launch itself still refuses to run on nothing).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterable, Mapping, Sequence

from zerospeed.launcher import resources
from zerospeed.launcher.cli import _ParseExit, launch, parse_command_line
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.hostfile import parse_hostfile, read_hostfile
from zerospeed.launcher.world import decode_world_info, encode_world_info

__all__ = [
    "decode_world_info",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's flags with the user script and its arguments (`user_script`, `user_args`)."""
    parsed, command = parse_command_line(sys.argv[1:] if args is None else list(args))
    parsed.user_script = command.script
    parsed.user_args = list(command.args)
    return parsed


def _parse_hostfile(hostfile_lines: Iterable[str]) -> collections.OrderedDict:
    """`{host: slots}` from a hostfile's lines, in order (malformed lines raise, naming the line)."""
    return collections.OrderedDict(parse_hostfile("\n".join(hostfile_lines)))


def fetch_hostfile(hostfile_path: str | None) -> collections.OrderedDict | None:
    """The hostfile's `{host: slots}`, or None when there is none (run on this machine)."""
    hosts = read_hostfile(hostfile_path)
    return None if hosts is None else collections.OrderedDict(hosts)


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int] | int], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """Apply `--include` / `--exclude` to `{host: [slots]}`: the hosts and slots left, in order."""
    pool = {host: resources._slot_list(slots) for host, slots in host_info.items()}
    if include_str and exclude_str:
        raise LauncherError("--include and --exclude are mutually exclusive; use one of them")
    if not include_str and not exclude_str:
        return pool
    flag, text = ("--include", include_str) if include_str else ("--exclude", exclude_str)
    specs = resources.parse_node_specs(text, flag)
    resources._check_specs(specs, pool, flag)
    apply = resources._apply_include if include_str else resources._apply_exclude
    chosen = apply(specs, pool)
    return {host: chosen[host] for host in pool if chosen.get(host)}


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> collections.OrderedDict:
    """`parse_resource_filter` over a hostfile's `{host: slot count}`."""
    hosts = {host: list(range(slots)) for host, slots in resource_pool.items()}
    return collections.OrderedDict(parse_resource_filter(hosts, inclusion, exclusion))


def main(args: Sequence[str] | None = None) -> int:
    """DeepSpeed's `runner.main(args=None)`: launch as the `deepspeed` command does, but a bad flag combination
    (`--num_gpus` with `--include`, ...) raises its `LauncherError`, a `ValueError` as DeepSpeed's, instead of
    becoming exit code 2; argparse's own errors exit (`SystemExit`) as DeepSpeed's do."""
    try:
        return launch(args)
    except _ParseExit as exc:
        raise SystemExit(exc.code) from None
