"""Submodules reachable as attributes before they are imported, as DeepSpeed's are.

`import deepspeed` imports most of DeepSpeed, so code reads `deepspeed.runtime.lr_schedules.X`
without importing that module. zerospeed imports lazily (`import zerospeed` stays light); a
package's `__getattr__ = lazy_submodules(__name__)` gives the same reach.
"""
from __future__ import annotations

import importlib


def lazy_submodules(package: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__
