"""Where each checkpoint file lives — DeepSpeed's names, so users' tooling and habits carry over.

    {dir}/latest                                           the newest complete tag (text)
    {dir}/{tag}/mp_rank_{t:02d}_model_states.pt            module (tp rank t's pieces), scheduler, counters,
                                                           config, client state (t = 00 without tensor parallelism)
    {dir}/{tag}/zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt  data-parallel rank d's fp32 shards, optimizer
                                                           state and RNG, of tp rank t
    {dir}/{tag}/zerospeed_manifest.json                    layout, partition map, checksums (written last)

A save is staged in `{dir}/.{tag}.partial` and renamed to `{dir}/{tag}` when complete (see Note
[tag directory swap] in atomic.py); `.{tag}.previous` briefly holds the tag it replaces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MODEL_STATES = "mp_rank_00_model_states.pt"  # tp rank 0's: the one file that holds the training state
MANIFEST = "zerospeed_manifest.json"
LATEST = "latest"
# What DeepSpeed's ds_to_universal requires in a tag's model states (Megatron-DeepSpeed passes it as client
# state; `ds_to_universal --inject_missing_state` writes this value for a plain model).
UNIVERSAL_INFO = {"universal_checkpoint_version": 0.4}


def model_states_name(tp_rank: int = 0) -> str:
    """File name of tensor-parallel rank `tp_rank`'s model states (DeepSpeed's `mp_rank_XX`)."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def optim_states_name(rank: int, tp_rank: int = 0) -> str:
    """File name of data-parallel rank `rank`'s shard of tensor-parallel rank `tp_rank`."""
    return f"zero_pp_rank_{rank}_mp_rank_{tp_rank:02d}_optim_states.pt"


def is_model_states_name(name: str) -> bool:
    """A tp rank's model-states file (not an expert file, `layer_..._mp_rank_00_model_states.pt`)."""
    return re.fullmatch(r"mp_rank_\d+_model_states\.pt", name) is not None


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


def check_tag(tag: object) -> str:
    """`tag` if it can name a directory inside the checkpoint folder, else ValueError saying why."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    if "/" in tag or "\\" in tag or tag in (".", ".."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (no path separators)")
    if tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must not start with '.' (hidden names are used for staging)")
    if tag != tag.strip() or any(c in tag for c in "\n\r\t\0"):
        raise ValueError(f"checkpoint tag {tag!r} must not contain surrounding whitespace or control characters")
    return tag


def check_save_dir(save_dir: object) -> Path:
    """`save_dir` as a Path. "" and None are DeepSpeed's ValueError (its test, `not save_dir`, word for
    word): an empty string would otherwise write the checkpoint into the working directory."""
    if not save_dir:
        raise ValueError(
            f"save_dir must be a non-empty string, got {save_dir!r} (pass the folder that "
            "holds `latest` and the tag directories)"
        )
    return Path(save_dir)


def check_load_dir(load_dir: object) -> Path:
    """`load_dir` as a Path; None is a TypeError, the type DeepSpeed raises (from os.path.join), with a
    message that names the argument. "" is the working directory, as in DeepSpeed."""
    if load_dir is None:
        raise TypeError(
            "load_dir must be a str or path, got None (pass the folder that holds `latest` and the tag directories)"
        )
    return Path(load_dir)


@dataclass(frozen=True)
class CheckpointPaths:
    """The paths of one tag inside a checkpoint folder."""

    root: Path
    tag: str

    @property
    def dir(self) -> Path:
        return self.root / self.tag

    @property
    def staging(self) -> Path:
        return self.root / f".{self.tag}.partial"

    @property
    def previous(self) -> Path:
        return self.root / f".{self.tag}.previous"

    @property
    def latest(self) -> Path:
        return self.root / LATEST
