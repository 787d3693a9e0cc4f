"""Which `deepspeed` distribution is installed: zerospeed's shim, a real DeepSpeed, or none.

Standard library only: the shim's start-up hook (compat/startup.py) and `import deepspeed` ask this
before anything heavy is imported.
"""

from __future__ import annotations

import importlib.metadata
import sys

DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose API (names, defaults) we mirror
SHIM_TAG = "zerospeed"  # the shim's version is DEEPSPEED_API_VERSION + "+zerospeed.<our version>"


def is_shim(dist: importlib.metadata.Distribution) -> bool:
    """True for zerospeed's own `deepspeed` distribution."""
    return f"+{SHIM_TAG}" in (dist.version or "")


def deepspeed_is_shim() -> bool:
    """True when the `deepspeed` distribution found first on sys.path (the one `import deepspeed` gets)
    is zerospeed's shim; False for a real DeepSpeed or none."""
    try:
        return is_shim(importlib.metadata.distribution("deepspeed"))
    except importlib.metadata.PackageNotFoundError:
        return False


def foreign_deepspeeds(path: list[str] | None = None) -> list[importlib.metadata.Distribution]:
    """Distributions named `deepspeed` on `path` (default sys.path) that are not zerospeed's shim."""
    found = importlib.metadata.distributions(name="deepspeed", path=path if path is not None else sys.path)
    return [d for d in found if not is_shim(d)]


def location(dist: importlib.metadata.Distribution) -> str:
    """The directory a distribution is installed in."""
    return str(dist.locate_file(""))
