"""The `deepspeed` import name as a rename of `zerospeed`.

Note [a rename, not a translation]: every public DeepSpeed name we provide lives at DeepSpeed's
path under `zerospeed` (`deepspeed.runtime.zero.partition_parameters` is
`zerospeed.zero.stage3.api`), so the shim needs no table: a meta-path finder maps
`deepspeed.<path>` to the module `zerospeed.<path>` — the same module object, not a copy, so
`isinstance` checks, module globals and monkeypatches agree whichever name was imported. A name we
do not provide fails as it would on a DeepSpeed without it (ModuleNotFoundError / AttributeError).

Note [never shadow a real DeepSpeed]: the shim is a distribution named `deepspeed` (that is what
transformers and accelerate look for: `find_spec("deepspeed")` and `metadata("deepspeed")`). pip
replaces it when the real DeepSpeed is installed into the same environment, and `zerospeed-compat
install` refuses to install over a real one. What remains is a real DeepSpeed in another
sys.path entry (a user site, a PYTHONPATH dir): then whichever comes first would win silently, so
`activate` refuses to import and names both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types

import zerospeed  # already imported: it is this package's parent (its __init__ imports no torch)
from zerospeed.compat.distribution import (  # noqa: F401 (this module's names since the shim began)
    DEEPSPEED_API_VERSION,
    SHIM_TAG,
    deepspeed_is_shim,
    foreign_deepspeeds,
    is_shim,
    location,
)
from zerospeed.compat.import_hooks import install_hook
from zerospeed.version import version_fields


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.<path>` by importing `zerospeed.<path>` and returning that module itself."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """Already executed under its zerospeed name."""


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """`deepspeed.<path>` -> `zerospeed.<path>` (Note [a rename, not a translation])."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        ours = "zerospeed." + fullname[len("deepspeed.") :]
        try:
            spec = importlib.util.find_spec(ours)
        except ModuleNotFoundError:
            return None
        if spec is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(ours), is_package=spec.submodule_search_locations is not None
        )


_FINDER = _DeepSpeedFinder()


def activate(name: str = "deepspeed") -> types.ModuleType:
    """Make the module `name` (the shim's `deepspeed` package) a view of `zerospeed`."""
    foreign = foreign_deepspeeds()
    if foreign:
        places = ", ".join(f"DeepSpeed {d.version} at {location(d)}" for d in foreign)
        raise ImportError(
            f"`import deepspeed` is ambiguous: zerospeed's deepspeed shim is installed and so is "
            f"{places}. Keep one: `zerospeed-compat uninstall` to use the real DeepSpeed, or "
            "`pip uninstall deepspeed` in the other location to use zerospeed "
            "(Note [never shadow a real DeepSpeed] in zerospeed/compat/alias.py)"
        )
    install_hook()  # Note [accelerate on a CPU-only machine], for an environment without the .pth

    module = sys.modules[name]
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    try:
        module.__version__ = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        module.__version__ = f"{DEEPSPEED_API_VERSION}+{SHIM_TAG}.{zerospeed.__version__}"
    vars(module).update(version_fields(module.__version__))  # __version_major__, __git_hash__, ... as DeepSpeed's

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if importlib.util.find_spec(f"zerospeed.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")  # a submodule, under its deepspeed name too
        try:
            return getattr(zerospeed, attr)
        except AttributeError:
            raise AttributeError(
                f"module 'deepspeed' (zerospeed) has no attribute {attr!r}; see docs/compat.md "
                "for the DeepSpeed names zerospeed provides"
            ) from None

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted(set(dir(zerospeed)) | {"__version__"})
    return module
