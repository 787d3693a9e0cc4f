"""zerospeed's version (one place; `zerospeed.__version__` and checkpoints read it), and DeepSpeed's
version information (`deepspeed.git_version_info`, `deepspeed.__version_major__`, ...).

zerospeed mirrors the API of one DeepSpeed release, `DEEPSPEED_API_VERSION`: that is the version a DeepSpeed
user's code sees as `deepspeed.__version__` and `deepspeed.git_version_info.version` (transformers,
accelerate and DeepSpeed's own elasticity check compare against it). A zerospeed install is built from no
DeepSpeed git tree, so the git hash and branch are unknown, written as DeepSpeed writes them then.
"""

from __future__ import annotations

import re

__version__ = "0.1.0"

DEEPSPEED_API_VERSION = "0.19.8"
"""The DeepSpeed release whose API (names, defaults, behaviours) zerospeed mirrors."""

version = DEEPSPEED_API_VERSION
git_hash = "unknown"
git_branch = "unknown"


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as "0.19.8" or "0.19.8+zerospeed.0.1.0"."""
    parts = [re.match(r"\d*", part).group() for part in text.split("+", 1)[0].split(".")[:3]]
    major, minor, patch = ([int(p or 0) for p in parts] + [0, 0, 0])[:3]
    return major, minor, patch


def version_fields(text: str) -> dict[str, object]:
    """DeepSpeed's version attributes of its root package, for a version string."""
    major, minor, patch = parse_version(text)
    return {
        "__version_major__": major,
        "__version_minor__": minor,
        "__version_patch__": patch,
        "__git_hash__": git_hash,
        "__git_branch__": git_branch,
    }


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the installed torch lies in [min_version, max_version] (DeepSpeed's
    `utils.torch.required_torch_version`; at least one bound must be given)."""
    import torch  # not at module level: `import zerospeed` stays free of torch
    from packaging.version import Version

    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version")
    installed = Version(torch.__version__.split("+")[0])
    if min_version is not None and Version(str(min_version)) > installed:
        return False
    return max_version is None or Version(str(max_version)) >= installed
