"""Command lines of trials (pure): the launcher's flags without ``--autotuning``, the script's
arguments with the trial's config path and the ``arg_mappings`` values in place, and the world the
trials run on (`TrialWorld`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zerospeed.utils.errors import ConfigError

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--deepscale_config")
AUTOTUNING_FLAG = "--autotuning"


def _flag_at(args: Sequence[str], i: int, flag: str) -> str | None:
    """The value of ``flag`` when ``args[i]`` is ``flag VALUE`` or ``flag=VALUE``, else None."""
    word = args[i]
    if word.startswith(flag + "="):
        return word[len(flag) + 1 :]
    if word == flag and i + 1 < len(args) and not args[i + 1].startswith("-"):
        return args[i + 1]
    return None


def find_config(args: Sequence[str]) -> str:
    """The path after the script's ``--deepspeed_config`` / ``--deepspeed`` argument."""
    for flag in CONFIG_FLAGS:
        for i in range(len(args)):
            value = _flag_at(args, i, flag)
            if value is not None:
                return value
    raise ConfigError(
        "zerospeed --autotuning needs the script's config: pass it as --deepspeed CONFIG.json or "
        "--deepspeed_config CONFIG.json after the script name"
    )


def set_flag(args: Sequence[str], flag: str, value: Any) -> list[str]:
    """``args`` with ``flag``'s value replaced (``flag V`` or ``flag=V``), or ``flag value`` appended."""
    out = list(args)
    for i in range(len(out)):
        if out[i].startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
        if out[i] == flag and i + 1 < len(out):
            out[i + 1] = str(value)
            return out
    return [*out, flag, str(value)]


def replace_config(args: Sequence[str], old: str, new: str) -> list[str]:
    """The script's arguments with its config path ``old`` changed to ``new``."""
    out = list(args)
    for flag in CONFIG_FLAGS:
        for i in range(len(out)):
            if out[i] == f"{flag}={old}":
                out[i] = f"{flag}={new}"
                return out
            if out[i] == flag and i + 1 < len(out) and out[i + 1] == old:
                out[i + 1] = new
                return out
    raise ConfigError(f"cannot find the config path {old!r} in the script's arguments")


def mapped_values(args: Sequence[str], mappings: dict[str, str] | None) -> dict[str, Any]:
    """The script's current values of the flags ``arg_mappings`` names, by config key (ints when they are)."""
    out: dict[str, Any] = {}
    for key, flag in (mappings or {}).items():
        for i in range(len(args)):
            value = _flag_at(args, i, flag.strip())
            if value is not None:
                out[key.strip()] = int(value) if value.isdigit() else value
    return out


def apply_mappings(args: Sequence[str], mappings: dict[str, str] | None, config: dict[str, Any]) -> list[str]:
    """Set every mapped flag to the trial config's value (DeepSpeed's ``arg_mappings``)."""
    out = list(args)
    for key, flag in (mappings or {}).items():
        key = key.strip()  # DeepSpeed's own docs write "gradient_accumulation_steps " with a space
        if key in config:
            out = set_flag(out, flag.strip(), config[key])
    return out


def launcher_flags(argv: Sequence[str], user_words: int) -> list[str]:
    """The launcher's own flags of ``argv`` (its last ``user_words`` words are the script and its
    arguments), without ``--autotuning MODE`` and a ``--`` separator."""
    ours = list(argv[: len(argv) - user_words])
    if ours and ours[-1] == "--":
        ours.pop()
    out, i = [], 0
    while i < len(ours):
        if ours[i] == AUTOTUNING_FLAG:
            i += 2
            continue
        if not ours[i].startswith(AUTOTUNING_FLAG + "="):
            out.append(ours[i])
        i += 1
    return out


def has_flag(flags: Sequence[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def _flag_value(flags: Sequence[str], *names: str) -> str | None:
    for i in range(len(flags)):
        for name in names:
            value = _flag_at(flags, i, name)
            if value is not None:
                return value
    return None


@dataclass(frozen=True)
class TrialWorld:
    """The nodes and ranks the trials run on, as the launcher resolved its flags, hostfile and devices.

    The ``zerospeed`` command passes its own resolution (the autotuner never reads a hostfile itself:
    the launcher is the layer above). `from_flags` is what the Python API assumes without one.
    """

    ranks_per_node: tuple[int, ...] = (1,)  # processes of each node, in node order
    hostfile: bool = False  # the hosts come from a hostfile (the launcher's runners apply)

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(self.ranks_per_node)

    @property
    def ranks(self) -> int:
        """Processes over all nodes (the world size)."""
        return sum(self.ranks_per_node)

    @classmethod
    def from_flags(cls, flags: Sequence[str]) -> TrialWorld:
        """``--num_nodes`` nodes of ``--num_gpus`` ranks each (1 when a flag is absent; ``-H`` counts as a
        hostfile)."""
        nodes = _flag_value(flags, "--num_nodes")
        per_node = _flag_value(flags, "--num_gpus", "--num_accelerators")
        hostfile = any(has_flag(flags, f) for f in ("--hostfile", "-H"))
        return cls((int(per_node or 1),) * int(nodes or 1), hostfile=hostfile)
