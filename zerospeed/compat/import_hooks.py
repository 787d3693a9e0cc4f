"""Post-import hooks: adjust a third-party module right after it runs, without importing it early.

Note [post-import hooks by name]: the shim's .pth file installs these hooks at every interpreter start
(compat/startup.py), so this module and what it imports must stay light: the standard library only,
no torch. The adjustment itself (compat/accelerate_cpu.py) needs zerospeed's accelerator, hence
torch; it is named in `HOOKS` as ``"module:function"`` and imported only when its target module is
imported — by then the target has imported torch itself. The table is the one place such a deferred
reference is written, so a reader finds it at the top of this file, as with the alias table
(zerospeed/deepspeed_paths.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

HOOKS = {
    # Note [accelerate on a CPU-only machine] in compat/accelerate_cpu.py
    "accelerate.state": "zerospeed.compat.accelerate_cpu:patch_state_module",
}
"""The module to adjust -> ``"module:function"`` called with it once it has run."""


def _apply(module: ModuleType) -> None:
    where, _, name = HOOKS[module.__name__].partition(":")
    getattr(importlib.import_module(where), name)(module)


class _Loader(importlib.abc.Loader):
    """The target's own loader, then its hook."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _apply(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self.loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install_hook() -> None:
    """Adjust each hooked module now if it is loaded, else when it is imported."""
    for target in HOOKS:
        if target in sys.modules:
            _apply(sys.modules[target])
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
